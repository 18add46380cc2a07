"""load(..., prologue_folds=True) on the Triton ops under the interpreter: the option reaches the
plan (ops/triton_ops.fold_norm_quant, fold_silu_quant) and the engine decodes the unfolded engine's bits. The kernel
and plan-level bits are in kernels/test_kernel_gemv_norm.py, test_kernel_gemv_silu.py and
kernels/test_kernel_fast_plan.py."""

from __future__ import annotations

import qruntime
import qruntime.loader


def test_prologue_folds_reach_the_plan_and_decode_the_same_bits(make_ckpt, compiled, monkeypatch, rng):
    """load(prologue_folds=True): the plan's AddRMSNormQuant nodes defer to their GEMVs and gate_up
    makes the SiLU-mul-quant (False: none does), and a prefill plus a batch-1 decode step give the
    unfolded engine's tokens and logprobs."""
    monkeypatch.setattr(qruntime.loader, "resolve_backend", lambda backend, device, dtype: "triton")
    art = compiled(make_ckpt("tiny", num_hidden_layers=1), "ptpc-fp8")
    prompt = [rng.randrange(1, 200) for _ in range(rng.randrange(2, 8))]
    params = qruntime.SamplingParams(max_tokens=2, ignore_eos=True, logprobs=2)
    results = []
    for folds in (True, False):
        with qruntime.load(
            art, device="cpu", backend="triton", cuda_graphs=False, num_kv_blocks=8, prologue_folds=folds
        ) as engine:
            ops = [n.op for n in engine.runner.plan.nodes]
            norms = [op for op in ops if type(op).__name__ == "AddRMSNormQuant"]
            assert len(norms) == 2 and all(op.defer == folds for op in norms)
            tails = [op for op in ops if type(op).__name__ == "PTPCLinear" and op.counter is not None]
            assert len(tails) == folds  # gate_up: its GEMV makes the SiLU-mul-quant (fold_silu_quant)
            out = engine.generate([prompt], params)[0]
            assert out.error is None, out.error
            results.append((out.token_ids, out.logprobs))
    assert results[0] == results[1], prompt
