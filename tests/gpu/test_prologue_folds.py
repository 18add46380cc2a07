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
        deferred = [n.op.defer for n in engine.runner.plan.nodes if type(n.op) is triton_ops.AddRMSNormQuant]
        assert deferred and all(d == folds for d in deferred)
        tails = [n.op for n in engine.runner.plan.nodes if getattr(n.op, "counter", None) is not None]
        assert bool(tails) == folds
        out = engine.generate([prompt], qruntime.SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2))[0]
    return out.token_ids, out.logprobs


def test_folded_norms_decode_as_the_launched_norms(gpu_artifact, cuda, rng):
    vocab = json.loads((gpu_artifact / "manifest.json").read_text())["spec"]["vocab_size"]
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]
    tokens, logprobs = _generate(gpu_artifact, prompt, True)
    want_tokens, want_logprobs = _generate(gpu_artifact, prompt, False)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs, strict=True):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=2e-2)
