"""An amd-gfx942 artifact on the Triton ops (qruntime.target): the loader hands the artifact's target
to the ops (RankConfig.target -> OpEnv.fp8), which quantize activations to e4m3fnuz and read the
weights the compiler stored as e4m3fnuz with doubled scales, and an FP8 KV cache in e4m3fnuz (its
codes read at twice the e4m3fn scales). Every product equals the e4m3fn one, so on CPU under
Triton's interpreter the amd artifact's greedy tokens and their logprobs equal the nvidia-sm90
artifact's of the same checkpoint, bit for bit (both with an FP8 cache in the amd target's x-packed
layout; a bf16 cache runs the same KV kernels for both targets). A one-layer dense model, a prefill and one decode step: the interpreter takes 3-4 s a step
here; the fused MoE's e4m3fnuz kernels are compared with the e4m3fn ones in
kernels/test_kernel_fnuz.py."""

from __future__ import annotations

import qruntime
import qruntime.loader
import torch

AMD = ("target=amd-gfx942",)


def test_the_amd_artifact_on_the_triton_ops_decodes_as_the_nvidia_one(make_ckpt, compiled, monkeypatch, rng):
    # load() takes the triton backend on a GPU only; on CPU its kernels run in Triton's interpreter
    monkeypatch.setattr(qruntime.loader, "resolve_backend", lambda backend, device, dtype: "triton")
    ckpt = make_ckpt("tiny", num_hidden_layers=1)
    prompt = [rng.randrange(1, 200) for _ in range(5)]
    # a prefill and a batch-1 decode step (o_proj's GEMV quantizes its row itself there)
    params = qruntime.SamplingParams(max_tokens=2, ignore_eos=True, logprobs=2)
    results = []
    for target in ((), AMD):
        art = compiled(ckpt, "ptpc-fp8", "kv_cache.layout=x-packed", "kv_cache.dtype=fp8_e4m3", *target)
        with qruntime.load(art, device="cpu", backend="triton", cuda_graphs=False, num_kv_blocks=8) as engine:
            ops = [node.op for node in engine.runner.plan.nodes]
            linears = [op for op in ops if type(op).__name__ == "PTPCLinear"]
            assert linears and {type(op).__module__ for op in linears} == {"qruntime.ops.triton_ops"}
            fp8 = torch.float8_e4m3fnuz if target else torch.float8_e4m3fn
            assert {op.env.fp8 for op in ops} == {fp8} and {p.dtype for p in engine.runner.kv_cache.k} == {fp8}
            out = engine.generate([prompt], params)[0]
            assert out.error is None, out.error
            results.append((out.token_ids, out.logprobs))
    assert results[0] == results[1], prompt  # tokens, and their logprobs as floats: equal, not close
