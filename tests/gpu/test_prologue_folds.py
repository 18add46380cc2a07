"""load(..., prologue_folds=True) on the GPU, in CUDA graphs: at batch-1 decode each AddRMSNormQuant
runs inside the qkv / gate_up GEMV that reads it (ops/triton_ops.fold_norm_quant) and gate_up's GEMV
makes the SiLU-mul-quant in its last program (fold_silu_quant); the engine's greedy
tokens are the unfolded engine's and their logprobs agree to the rounding that the two sums of
squares' orders allow (kernels/gemv_prologue.py)."""

from __future__ import annotations

import json

import pytest
import qruntime
import qruntime.ops.triton_ops as triton_ops

pytestmark = pytest.mark.gpu


def _generate(artifact, prompt, folds: bool) -> tuple[list[int], list]:
    with qruntime.load(
        artifact, device="cuda", max_num_seqs=8, kv_cache_memory=256 << 20, prologue_folds=folds
    ) as engine:
        ops = [n.op for n in engine.runner.plan.nodes]
        deferred = [op for op in ops if type(op) is triton_ops.AddRMSNormQuant and op.defer]
        tails = [op for op in ops if type(op) is triton_ops.PTPCLinear and op.counter is not None]
        assert bool(deferred) == bool(tails) == folds
        routed = [op for op in ops if type(op) is triton_ops.AddRMSNorm and op.defer]  # fold_router_norm: default
        assert len(routed) == sum(type(op) is triton_ops.MoE for op in ops)  # the final norm is never deferred
        out = engine.generate([prompt], qruntime.SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2))[0]
    return out.token_ids, out.logprobs


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_folded_norms_decode_as_the_launched_norms(gpu_artifact, make_ckpt, compiled, cuda, rng, model):
    """moe: the norms before the fused MoEs run in their routing launches, the combines in the next
    layer's qkv GEMV."""
    artifact = gpu_artifact
    if model == "moe":
        moe = {"hidden_size": 256, "head_dim": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
        artifact = compiled(make_ckpt("tiny-moe", **moe), "ptpc-fp8")
    vocab = json.loads((artifact / "manifest.json").read_text())["spec"]["vocab_size"]
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]
    tokens, logprobs = _generate(artifact, prompt, True)
    want_tokens, want_logprobs = _generate(artifact, prompt, False)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs, strict=True):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=2e-2)
