"""Split-K reductions and MoE combines folded into the next kernel (ops/triton_ops.
fold_split_k_reductions) on the GPU, in CUDA graphs: with every small-batch GEMM forced to split K,
an engine whose GEMMs hand their partials (and whose MoE its expert rows) to the next kernel
generates the bits of one that launches each reduction and combine."""

from __future__ import annotations

import json

import pytest
import qruntime
import qruntime.ops.triton_ops as triton_ops
from qruntime.kernels.fp8_gemm import GemmConfig

pytestmark = pytest.mark.gpu


def _generate(artifact, prompts) -> list:
    with qruntime.load(artifact, device="cuda", max_num_seqs=8, kv_cache_memory=256 << 20) as engine:
        outs = engine.generate(prompts, qruntime.SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2))
        outs += engine.generate(prompts[:1], qruntime.SamplingParams(max_tokens=12, ignore_eos=True))
    return [(o.token_ids, o.logprobs) for o in outs]


def test_folded_reductions_give_the_launched_reductions_bits(gpu_artifact, cuda, rng, monkeypatch):
    plan = triton_ops.PTPCLinear._plan
    split = GemmConfig(16, 32, 64, 2, 4, 3)
    monkeypatch.setattr(triton_ops.PTPCLinear, "_plan", lambda op, m: ("triton", split) if m <= 16 else plan(op, m))
    manifest = json.loads((gpu_artifact / "manifest.json").read_text())
    vocab, layers = manifest["spec"]["vocab_size"], manifest["kv_cache"]["num_layers"]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (9, 40, 3, 17)]
    counts: list[int] = []
    fold = triton_ops.fold_split_k_reductions
    monkeypatch.setattr(triton_ops, "fold_split_k_reductions", lambda p: counts.append(fold(p)) or counts[-1])
    folded = _generate(gpu_artifact, prompts)
    assert counts == [4 * layers]  # qkv, o, gate_up and down of every layer
    monkeypatch.setattr(triton_ops, "fold_split_k_reductions", lambda p: 0)
    assert folded == _generate(gpu_artifact, prompts)


def test_folded_moe_combines_give_the_launched_combines_bits(make_ckpt, compiled, cuda, rng, monkeypatch):
    artifact = compiled(
        make_ckpt("tiny-moe", hidden_size=256, head_dim=128, num_attention_heads=4, num_key_value_heads=2), "ptpc-fp8"
    )
    vocab = json.loads((artifact / "manifest.json").read_text())["spec"]["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (9, 40, 3, 17)]
    counts: list[int] = []
    fold = triton_ops.fold_split_k_reductions
    monkeypatch.setattr(triton_ops, "fold_split_k_reductions", lambda p: counts.append(fold(p)) or counts[-1])
    monkeypatch.setattr(triton_ops, "PAIR_ROWS_READERS", (triton_ops.AddRMSNorm, triton_ops.AddRMSNormQuant))
    folded = _generate(artifact, prompts)  # the combine's folding turned on (off by default: slower)
    assert counts and counts[0] >= 2  # the combine of each of its two MoE layers at least
    monkeypatch.setattr(triton_ops, "fold_split_k_reductions", lambda p: 0)
    assert folded == _generate(artifact, prompts)
