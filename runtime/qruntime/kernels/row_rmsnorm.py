"""AddRMSNorm of one token's row, op for op as the norm kernel computes it (add_rmsnorm_quant.py
takes its rstd from here), for a launch that reads the row anyway and so folds the norm in instead
of paying a launch for it: the fused MoE's one-token routing launch (moe_routing.moe_router_one's
rms), whose every program reads the whole row for its router rows.

Each program normalizes the row with the arithmetic of add_rmsnorm_quant.py's kernel, op for op:
h = D(x + residual), the fp32 sum of squares of h over the same tiles in the same order, rstd =
1 / sqrt(sum / H + eps) in IEEE ops, y = D(w * D(h * rstd)). So y is that kernel's, bit for bit
wherever the two sums of squares agree (always under the interpreter; on a GPU the tree of a tile's
sum may differ in its last bit, as the kernel's own note says of torch's order).

A norm folded this way pays only where its extra work is small beside the launch's own: the router
reads the row anyway. Folded into a PTPC GEMV's prologue instead, every one of its ~N/4 programs
re-read the row, and qwen3-8b's batch-1 decode got 16% slower on an H200 (docs/OPS.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from qruntime.kernels.dynamic_quant import round_to


@triton.jit
def rms_rstd(sum_sq, H, eps):
    """rsqrt(mean + eps) as torch's CPU reference rounds it: 1 / sqrt(sum / H + eps), IEEE ops
    (tl.rsqrt is an approximation on the GPU)."""
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(sum_sq, H * 1.0) + eps))


@triton.jit
def residual_sum(x_ptr, r_ptr, offs, mask, DTYPE: tl.constexpr, HW: tl.constexpr):
    """h = D(x + residual) at offs, as fp32 holding D values; 0 past mask."""
    h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return round_to(h + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32), DTYPE, HW)


@triton.jit
def row_rstd(
    x_ptr, r_ptr, ro_ptr, w_ptr, H, eps, WRITE, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, HW: tl.constexpr
):
    """rstd of the row h = D(x + residual) [H], its squares summed over NUM_CHUNKS tiles of BLOCK as
    add_rmsnorm_quant's kernel sums them; where WRITE, h is stored at ro_ptr (w_ptr, the norm
    weight, gives the model dtype D)."""
    dtype = w_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for chunk in tl.static_range(NUM_CHUNKS):
        offs = chunk * BLOCK + cols
        mask = offs < H
        h = residual_sum(x_ptr, r_ptr, offs, mask, dtype, HW)
        if WRITE:
            tl.store(ro_ptr + offs, h.to(dtype), mask=mask)  # exact: h is a D value
        acc += h * h
    return rms_rstd(tl.sum(acc, axis=0), H, eps)


@triton.jit
def normed_value(x_ptr, r_ptr, w_ptr, offs, mask, rstd, HW: tl.constexpr):
    """y = D(w * D(h * rstd)) at offs, in fp32 (0 past mask)."""
    dtype = w_ptr.dtype.element_ty
    h = residual_sum(x_ptr, r_ptr, offs, mask, dtype, HW)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return round_to(w * round_to(h * rstd, dtype, HW), dtype, HW)
