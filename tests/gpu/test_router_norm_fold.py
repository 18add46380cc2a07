"""fold_router_norm on the GPU, in CUDA graphs: at batch-1 decode the AddRMSNorm before each fused
MoE runs inside the MoE's one-token routing launch (moe_routing.moe_router_one's rms); the
engine's greedy tokens are those of an engine that launches the norms, and their logprobs agree to
the rounding that the two sums of squares' orders allow (kernels/row_rmsnorm.py)."""

from __future__ import annotations

import json

import pytest
import qruntime
import qruntime.ops.triton_ops as triton_ops

pytestmark = pytest.mark.gpu


def _generate(artifact, prompt, fold: bool, monkeypatch) -> tuple[list[int], list]:
    if not fold:
        monkeypatch.setattr(triton_ops, "fold_router_norm", lambda plan: 0)
    with qruntime.load(artifact, device="cuda", max_num_seqs=8, kv_cache_memory=256 << 20) as engine:
        ops = [n.op for n in engine.runner.plan.nodes]
        routed = [op for op in ops if type(op) is triton_ops.AddRMSNorm and op.defer]
        moes = [op for op in ops if type(op) is triton_ops.MoE and op.kernel is not None]
        assert moes and len(routed) == len(moes) * fold  # the final norm (before lm_head) is never deferred
        out = engine.generate([prompt], qruntime.SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2))[0]
    monkeypatch.undo()
    return out.token_ids, out.logprobs


def test_folded_norms_decode_as_the_launched_norms(make_ckpt, compiled, cuda, rng, monkeypatch):
    moe = {"hidden_size": 256, "head_dim": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    artifact = compiled(make_ckpt("tiny-moe", **moe), "ptpc-fp8")
    vocab = json.loads((artifact / "manifest.json").read_text())["spec"]["vocab_size"]
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]
    tokens, logprobs = _generate(artifact, prompt, True, monkeypatch)
    want_tokens, want_logprobs = _generate(artifact, prompt, False, monkeypatch)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs, strict=True):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=2e-2)
