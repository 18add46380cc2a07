"""Outputs left as slices to add up: a split-K GEMM's fp32 partials (fp8_gemm.SplitKPartials) and a
fused MoE's weighted expert rows (moe_combine.PairRows). A row kernel that reads such an output in
place of the [M, N] tensor (add_rmsnorm_quant, silu_mul_quant, qknorm_rope_kvwrite) adds the slices
itself with `deferred_value`, in the order and arithmetic of the launch it saves (the split-K
reduction, the MoE combine), so every element keeps its bits; ops/triton_ops.py decides where.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qruntime.kernels.dynamic_quant import round_to


@triton.jit
def deferred_value(
    base, xs_ptr, ws_ptr, row, cols, mask, slice_stride, row_stride, stride_xs, stride_ws,
    SLICES: tl.constexpr, SCALED: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """Elements (row, cols) of the output: the sum from zero, in slice order, of fp32(base[s *
    slice_stride + row * row_stride + cols]) for s < SLICES, times xs[row] then ws[cols] when SCALED,
    rounded to DTYPE; fp32 out (0 where masked). cols may have any shape."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for s in tl.static_range(SLICES):
        acc += tl.load(base + s * slice_stride + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        xs = tl.load(xs_ptr + row * stride_xs)
        acc = acc * xs * tl.load(ws_ptr + cols * stride_ws, mask=mask, other=0.0).to(tl.float32)
    return round_to(acc, DTYPE, HW)
