"""The AddRMSNorm + per-token quantization of one token's row, computed inside the GEMV that reads
it (fp8_gemm.ptpc_fp8_gemv_norm_quant) instead of in a launch of its own.

Every GEMV program normalizes the whole row itself (x, residual and the norm weight are a few KB,
read from L2) with the arithmetic of add_rmsnorm_quant.py's kernel, op for op: h = D(x + residual),
the fp32 sum of squares of h over the same tiles in the same order, rstd = 1 / sqrt(sum / H + eps)
in IEEE ops, y = D(w * D(h * rstd)). So y, its max |y| and the e4m3 codes are that kernel's, bit
for bit wherever the two sums of squares agree (always under the interpreter; on a GPU the tree of
a tile's sum may differ in its last bit, as the kernel's own note says of torch's order).
"""

from __future__ import annotations

import triton
import triton.language as tl

from qruntime.kernels.deferred_sum import deferred_value
from qruntime.kernels.dynamic_quant import round_to


@triton.jit
def rms_rstd(sum_sq, H, eps):
    """rsqrt(mean + eps) as torch's CPU reference rounds it: 1 / sqrt(sum / H + eps), IEEE ops
    (tl.rsqrt is an approximation on the GPU)."""
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(sum_sq, H * 1.0) + eps))


@triton.jit
def residual_sum(
    x_ptr, r_ptr, offs, mask, sx_ptr, sw_ptr, slice_stride, stride_sx, stride_sw,
    SLICES: tl.constexpr, SCALED: tl.constexpr, HAS_RES: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """h = D(x + residual) at offs (x itself without a residual), as fp32 holding D values; 0 past mask.
    SLICES > 0: x is a deferred output's SLICES slices (deferred_sum.py: split-K partials with their
    scales sx, sw when SCALED, or a fused MoE's k weighted expert rows), added up first as the
    launch they stand for would."""
    if SLICES > 0:
        h = deferred_value(
            x_ptr, sx_ptr, sw_ptr, 0, offs, mask, slice_stride, 0, stride_sx, stride_sw, SLICES, SCALED, DTYPE, HW
        )
    else:
        h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h = round_to(h + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32), DTYPE, HW)
    return h


@triton.jit
def row_rstd(
    x_ptr, r_ptr, ro_ptr, w_ptr, H, eps, WRITE, sx_ptr, sw_ptr, slice_stride, stride_sx, stride_sw,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, SLICES: tl.constexpr, SCALED: tl.constexpr,
    HAS_RES: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """rstd of the row h = D(x + residual) [H], its squares summed over NUM_CHUNKS tiles of BLOCK as
    add_rmsnorm_quant's kernel sums them; where WRITE (and HAS_RES), h is stored at ro_ptr (w_ptr,
    the norm weight, gives the model dtype D)."""
    dtype = w_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for chunk in tl.static_range(NUM_CHUNKS):
        offs = chunk * BLOCK + cols
        mask = offs < H
        h = residual_sum(
            x_ptr, r_ptr, offs, mask, sx_ptr, sw_ptr, slice_stride, stride_sx, stride_sw, SLICES, SCALED, HAS_RES,
            dtype, HW,
        )  # fmt: skip
        if HAS_RES:  # noqa: SIM102 (a constexpr branch around a runtime one)
            if WRITE:
                tl.store(ro_ptr + offs, h.to(dtype), mask=mask)  # exact: h is a D value
        acc += h * h
    return rms_rstd(tl.sum(acc, axis=0), H, eps)


@triton.jit
def normed_value(
    x_ptr, r_ptr, w_ptr, offs, mask, rstd, sx_ptr, sw_ptr, slice_stride, stride_sx, stride_sw,
    SLICES: tl.constexpr, SCALED: tl.constexpr, HAS_RES: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """y = D(w * D(h * rstd)) at offs, in fp32 (0 past mask)."""
    dtype = w_ptr.dtype.element_ty
    h = residual_sum(
        x_ptr, r_ptr, offs, mask, sx_ptr, sw_ptr, slice_stride, stride_sx, stride_sw, SLICES, SCALED, HAS_RES, dtype, HW
    )
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return round_to(w * round_to(h * rstd, dtype, HW), dtype, HW)
