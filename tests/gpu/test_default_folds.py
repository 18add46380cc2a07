"""The default folds that take a launch's work into another launch, on the GPU in CUDA graphs, each
against an engine that launches it: fold_router_norm (the AddRMSNorm before each fused MoE in its
one-token routing launch) and fold_qknorm_rope (a decode step's QK-norm + RoPE + KV write in the
decode attention's partition programs). Greedy tokens equal, logprobs within the rounding that the
sums of squares' orders allow (kernels/gemv_prologue.py, kernels/qknorm_rope_kvwrite.py)."""

from __future__ import annotations

import json

import pytest
import qruntime
import qruntime.ops.triton_ops as triton_ops

pytestmark = pytest.mark.gpu


def _generate(artifact, prompt, leave_out: str | None, monkeypatch) -> tuple[list[int], list]:
    if leave_out is not None:
        monkeypatch.setattr(triton_ops, leave_out, lambda plan: 0)
    with qruntime.load(artifact, device="cuda", max_num_seqs=8, kv_cache_memory=256 << 20) as engine:
        ops = [n.op for n in engine.runner.plan.nodes]
        routed = [op for op in ops if type(op) is triton_ops.AddRMSNorm and op.defer]
        moes = [op for op in ops if type(op) is triton_ops.MoE and op.kernel is not None]
        assert len(routed) == len(moes) * (leave_out != "fold_router_norm")  # never the final norm
        qk = [op for op in ops if type(op) is triton_ops.QKNormRoPEKVWrite]
        assert qk and sum(op.defer for op in qk) == len(qk) * (leave_out != "fold_qknorm_rope")
        out = engine.generate([prompt], qruntime.SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2))[0]
    monkeypatch.undo()
    return out.token_ids, out.logprobs


@pytest.mark.parametrize(
    ("model", "fold"), [("moe", "fold_router_norm"), ("dense", "fold_qknorm_rope"), ("moe", "fold_qknorm_rope")]
)
def test_folded_launches_decode_as_the_launched_ones(
    gpu_artifact, make_ckpt, compiled, cuda, rng, model, fold, monkeypatch
):
    artifact = gpu_artifact
    if model == "moe":
        moe = {"hidden_size": 256, "head_dim": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
        artifact = compiled(make_ckpt("tiny-moe", **moe), "ptpc-fp8")
    vocab = json.loads((artifact / "manifest.json").read_text())["spec"]["vocab_size"]
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]
    tokens, logprobs = _generate(artifact, prompt, None, monkeypatch)
    want_tokens, want_logprobs = _generate(artifact, prompt, fold, monkeypatch)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs, strict=True):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=2e-2)
