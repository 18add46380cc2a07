"""Programmatic dependent launch (kernels/pdl.py) on the GPU: an engine whose kernels launch with
PDL (each waits on the device for the one before) gives the same bits as one whose kernels launch
plainly, through decode graphs of several batch sizes, piecewise prefill graphs, eager steps and
the fused MoE; with and without the GEMMs' weight prefetch before the wait. A kernel that read its
inputs before the wait would race the kernel that writes them and differ here, some of the time."""

from __future__ import annotations

import json

import pytest
import qruntime
import qruntime.ops.triton_ops as triton_ops

pytestmark = pytest.mark.gpu

MOE_MODEL = {"hidden_size": 256, "head_dim": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


def _run(artifact, pdl: bool, prompts, prefetch_k: int = 0) -> list:
    default_prefetch = triton_ops.PTPCLinear.prefetch_k
    triton_ops.PTPCLinear.prefetch_k = prefetch_k
    try:
        with qruntime.load(artifact, device="cuda", pdl=pdl, max_num_seqs=8, kv_cache_memory=256 << 20) as engine:
            assert engine.description["pdl"] is pdl
            outs = engine.generate(prompts, qruntime.SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3))
            # without logprobs, and fewer at a time: the batch-1 and batch-2 graphs
            outs += engine.generate(prompts[:2], qruntime.SamplingParams(max_tokens=12, ignore_eos=True))
            outs += engine.generate(prompts[3:4], qruntime.SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        triton_ops.PTPCLinear.prefetch_k = default_prefetch
    return [(o.token_ids, o.logprobs) for o in outs]


def _prompts(rng, artifact) -> list[list[int]]:
    vocab = json.loads((artifact / "manifest.json").read_text())["spec"]["vocab_size"]
    lengths = (5, 37, 300, 1, 64, 129)  # 300: a piecewise prefill over several chunks' buckets
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("prefetch_k", [0, 1024])
def test_pdl_launches_give_the_plain_launches_bits(gpu_artifact, cuda, rng, prefetch_k):
    prompts = _prompts(rng, gpu_artifact)
    plain = _run(gpu_artifact, False, prompts)
    assert plain == _run(gpu_artifact, True, prompts, prefetch_k)


def test_pdl_moe_gives_the_plain_bits(make_ckpt, compiled, cuda, rng):
    artifact = compiled(make_ckpt("tiny-moe", **MOE_MODEL), "ptpc-fp8")
    prompts = _prompts(rng, artifact)
    assert _run(artifact, False, prompts) == _run(artifact, True, prompts)
