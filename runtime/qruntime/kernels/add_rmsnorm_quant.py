"""Residual add + Qwen3 RMSNorm, optionally followed by per-token FP8 quantization
(the `AddRMSNormQuant` op with group_size 0, and `AddRMSNorm` for the final norm before lm_head).

Reference (qruntime.ops.AddRMSNorm(Quant), qruntime.ops.functional.rms_norm / dynamic_quant), in
this rounding order, D being the model dtype:
    h = D(x + residual)                                  (residual_out; x itself when no residual)
    n = D(h32 * rsqrt(mean(h32²) + eps))                 (normalize in fp32, cast to D)
    y = D(w * n)                                         (times the weight, in D)
    ys = max(amax|y| / 448, 1e-12),  yq = fp8(clamp(y / ys, ±448))
Each D(...) is one fp32 op rounded to nearest even, as torch computes bf16 elementwise ops. The only
difference from torch is the order of the fp32 sum of squares (a tree here): the mean and rsqrt
(1 / sqrt, IEEE, as torch on the CPU) may then differ in their last bit, which moves a bf16 n by
one ulp in about 1 element in 10^5 (y by up to 2 ulps there, yq by one e4m3 step far more
rarely). Everything else (residual_out, the scale, the e4m3 rounding) is exact.

One program per token row. H <= MAX_BLOCK (8192, every Qwen3 hidden size): the row is one
register tile, read and written once (x, residual, w in; residual_out, yq, ys out). Wider rows loop
over column chunks: pass 1 writes residual_out and sums squares, pass 2 takes amax of y, pass 3
quantizes (passes 2 and 3 recompute h and y from x and residual, mostly from L2).
With no residual, residual_out is x itself (the same tensor, as the reference returns it): nothing
is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qruntime.kernels.deferred_sum import deferred_value
from qruntime.kernels.dynamic_quant import (
    FP8,
    MAX_BLOCK,
    check_model_dtype,
    fnuz_format,
    fp8_e4m3_code,
    fp8_scale,
    quant_scale,
    round_to,
    row_config,
    rows_of,
    use_hw_casts,
)
from qruntime.kernels.fp8_gemm import SplitKPartials, check_partials
from qruntime.kernels.moe_combine import PairRows
from qruntime.kernels.pdl import launch_options, wait_for_inputs
from qruntime.kernels.row_rmsnorm import rms_rstd


@triton.jit
def _normed_row(x_row, r_row, w_ptr, offs, mask, rstd, HAS_RES: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr):
    """y = D(w * D(h * rstd)) of one chunk, recomputing h = D(x + residual); fp32 out, 0 past H."""
    h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h = round_to(h + tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32), DTYPE, HW)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return round_to(w * round_to(h * rstd, DTYPE, HW), DTYPE, HW)


@triton.jit
def normalize_row(
    h, w_ptr, cols, mask, y_row, s_ptr, H, eps, QUANT: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr,
    FNUZ: tl.constexpr = False,
):  # fmt: skip
    """The tail of one row held in one tile: h (fp32 holding DTYPE values, 0 past H) -> y = D(w * D(h *
    rstd)) stored at y_row, as e4m3 codes with the scale at s_ptr when QUANT (also the fused all-reduce's;
    FNUZ: e4m3fnuz codes, the scale doubled, as dynamic_quant's)."""
    rstd = rms_rstd(tl.sum(h * h, axis=0), H, eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = round_to(w * round_to(h * rstd, DTYPE, HW), DTYPE, HW)
    if QUANT:
        scale = quant_scale(tl.max(tl.abs(y), axis=0))
        tl.store(y_row + cols, fp8_e4m3_code(y, scale, tl.math.div_rn(1.0, scale), HW, FNUZ), mask=mask)
        tl.store(s_ptr, fp8_scale(scale, FNUZ))
    else:
        tl.store(y_row + cols, y.to(DTYPE), mask=mask)


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,  # [T, H] model dtype, unit column stride
    r_ptr,  # [T, H] residual (unused without HAS_RES)
    w_ptr,  # [H]
    ro_ptr,  # [T, H] residual_out, contiguous (unused without HAS_RES)
    y_ptr,  # [T, H]: uint8 view of the fp8 yq when QUANT, else y in the model dtype; contiguous
    s_ptr,  # [T] fp32 ys (unused without QUANT)
    xs_ptr,  # SPLIT: x is SPLIT slices to add (deferred_sum.py); SCALED: their scales xs [T, 1], ws [H, 1]
    ws_ptr,
    slice_stride,
    row_stride,
    stride_xs,
    stride_ws,
    H,
    stride_x,
    stride_r,
    eps,
    SPLIT: tl.constexpr,  # 0: x is [T, H] in the model dtype
    SCALED: tl.constexpr,
    HAS_RES: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,  # > 1: SPLIT is 0
    HW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    FNUZ: tl.constexpr = False,  # QUANT: e4m3fnuz codes (amd-gfx942), the scales doubled
):
    wait_for_inputs(PDL)
    DTYPE: tl.constexpr = w_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    ro_row = ro_ptr + row * H
    y_row = y_ptr + row * H
    cols = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:
        mask = cols < H
        if SPLIT:  # the split-K reduction or the MoE combine, here instead of in a launch of its own
            h = deferred_value(
                x_ptr, xs_ptr, ws_ptr, row, cols, mask, slice_stride, row_stride, stride_xs, stride_ws,
                SPLIT, SCALED, DTYPE, HW,
            )  # fmt: skip
        else:
            h = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            h = round_to(h + tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32), DTYPE, HW)
            tl.store(ro_row + cols, h.to(DTYPE), mask=mask)  # exact: h is a DTYPE value
        normalize_row(h, w_ptr, cols, mask, y_row, s_ptr + row, H, eps, QUANT, DTYPE, HW, FNUZ)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < H
            h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                h = round_to(h + tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32), DTYPE, HW)
                tl.store(ro_row + offs, h.to(DTYPE), mask=mask)
            acc += h * h
        rstd = rms_rstd(tl.sum(acc, axis=0), H, eps)
        if QUANT:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for c in range(NUM_CHUNKS):
                offs = c * BLOCK + cols
                y = _normed_row(x_row, r_row, w_ptr, offs, offs < H, rstd, HAS_RES, DTYPE, HW)
                amax = tl.maximum(amax, tl.abs(y))
            scale = quant_scale(tl.max(amax, axis=0))
            inv_scale = tl.math.div_rn(1.0, scale)
            for c in range(NUM_CHUNKS):
                offs = c * BLOCK + cols
                mask = offs < H
                y = _normed_row(x_row, r_row, w_ptr, offs, mask, rstd, HAS_RES, DTYPE, HW)
                tl.store(y_row + offs, fp8_e4m3_code(y, scale, inv_scale, HW, FNUZ), mask=mask)
            tl.store(s_ptr + row, fp8_scale(scale, FNUZ))
        else:
            for c in range(NUM_CHUNKS):
                offs = c * BLOCK + cols
                mask = offs < H
                y = _normed_row(x_row, r_row, w_ptr, offs, mask, rstd, HAS_RES, DTYPE, HW)
                tl.store(y_row + offs, y.to(DTYPE), mask=mask)


DEFERRED = (SplitKPartials, PairRows)  # outputs this kernel adds up itself (deferred_sum.py)


def _check(x, residual: torch.Tensor | None, w: torch.Tensor, max_block: int):
    """(x, residual) ready for the kernel: x a [T, H] tensor, or a deferred output (SplitKPartials,
    PairRows) the kernel adds up itself (added up here first when it cannot: a row wider than one
    tile, or no residual, whose residual_out is x itself)."""
    if isinstance(x, DEFERRED):
        if residual is not None and row_config(x.shape[1], max_block)[1] == 1:
            check_partials(x, residual, w)
            return x, rows_of("residual", residual)
        x = x.reduce()
    check_model_dtype("x", x)
    x = rows_of("x", x)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(
                f"residual must match x: got {tuple(residual.shape)} {residual.dtype} {residual.device}, "
                f"x is {tuple(x.shape)} {x.dtype} {x.device}"
            )
        residual = rows_of("residual", residual)
    if w.shape != (x.shape[1],) or w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"w must be [{x.shape[1]}] {x.dtype} on {x.device}, got {tuple(w.shape)} {w.dtype} {w.device}")
    return x, residual


def _launch(
    x, residual, w, eps, residual_out, y, ys, quant: bool, max_block: int, pdl: bool, fnuz: bool = False
) -> None:
    tokens, hidden = x.shape
    if tokens == 0:
        return
    block, chunks, num_warps = row_config(hidden, max_block)
    has_res = residual is not None
    split = isinstance(x, DEFERRED)
    part, xs, ws, slice_stride, row_stride, stride_xs, stride_ws = x.sum_args() if split else (x, x, x, 0, 0, 0, 0)
    _add_rmsnorm_kernel[(tokens,)](
        part,
        residual if has_res else x,
        w.contiguous(),
        residual_out if has_res else x,
        y,
        ys if quant else w,
        xs,
        ws,
        slice_stride,
        row_stride,
        stride_xs,
        stride_ws,
        hidden,
        0 if split else x.stride(0),
        residual.stride(0) if has_res else 0,
        float(eps),
        SPLIT=x.slices if split else 0,
        SCALED=split and x.scaled,
        HAS_RES=has_res,
        QUANT=quant,
        BLOCK=block,
        NUM_CHUNKS=chunks,
        HW=use_hw_casts(w),
        FNUZ=fnuz,
        num_warps=num_warps,
        **launch_options(pdl),
    )


def add_rmsnorm_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    *,
    max_block: int = MAX_BLOCK,
    pdl: bool = False,
    fp8: torch.dtype = FP8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused residual add, RMSNorm and per-token FP8 quantization.

    x, residual [T, H] (same model dtype: bf16 | fp16 | fp32), w [H] (same dtype), eps ->
    (yq [T, H] fp8 e4m3, ys [T, 1] fp32, residual_out [T, H]): residual_out = x + residual rounded to
    the model dtype (x itself when residual is None), y = rms_norm(residual_out, w, eps), then
    qruntime.ops.functional.dynamic_quant(y, 0). `max_block` (a power of two) caps the register
    tile; wider rows take the chunked three-pass path (tests force it at small H). pdl: launch with
    programmatic dependent launch (kernels/pdl.py; Hopper GPUs only). x may be a split-K GEMM's
    SplitKPartials (fp8_gemm.py) or a fused MoE's PairRows (moe_combine.py), added up in this launch.
    fp8 float8_e4m3fnuz (amd-gfx942): yq as e4m3fnuz with ys doubled (dynamic_quant's fp8)."""
    fnuz = fnuz_format(fp8)
    x, residual = _check(x, residual, w, max_block)
    tokens, hidden = x.shape
    yq = torch.empty(tokens, hidden, dtype=fp8, device=x.device)
    ys = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
    residual_out = x if residual is None else torch.empty_like(residual, memory_format=torch.contiguous_format)
    _launch(x, residual, w, eps, residual_out, yq.view(torch.uint8), ys, True, max_block, pdl, fnuz)
    return yq, ys, residual_out


@dataclass(frozen=True)
class DeferredRMSNorm:
    """The AddRMSNorm op's y left to its reader (ops/triton_ops.fold_router_norm): one token's x,
    residual and norm weight, which a fused MoE's one-token routing launch normalizes as it reads
    them (moe_routing.moe_router_one's rms), writing residual_out (already handed to the op's other
    readers). `normalize()` is the add_rmsnorm launch instead, into the same residual_out."""

    x: torch.Tensor
    residual: torch.Tensor
    w: torch.Tensor
    eps: float
    residual_out: torch.Tensor
    pdl: bool = False

    @classmethod
    def of(cls, x, residual, w, eps: float, pdl: bool) -> DeferredRMSNorm | None:
        """The deferred row, or None unless x and the residual are one token's rows of w's dtype with
        unit column stride (plain tensors)."""
        rows = (x, residual)
        if not all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.stride(1) == 1 for t in rows):
            return None
        if tuple(x.shape) != (1, w.shape[0]) or residual.shape != x.shape or {x.dtype, residual.dtype} != {w.dtype}:
            return None
        residual_out = torch.empty_like(residual, memory_format=torch.contiguous_format)
        return cls(x, residual, w, eps, residual_out, pdl)

    def rms_args(self) -> tuple:
        """(residual, norm weight, residual_out, eps): moe_router_one's rms."""
        return (self.residual, self.w.contiguous(), self.residual_out, self.eps)

    def normalize(self) -> torch.Tensor:
        """y in a launch of its own (add_rmsnorm's), residual_out written as the routing launch would."""
        y = torch.empty_like(self.x, memory_format=torch.contiguous_format)
        _launch(self.x, self.residual, self.w, self.eps, self.residual_out, y, None, False, MAX_BLOCK, self.pdl)
        return y


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    *,
    max_block: int = MAX_BLOCK,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add and RMSNorm, unquantized (the final norm before lm_head).

    x, residual [T, H] (same model dtype), w [H], eps -> (y [T, H] model dtype, residual_out [T, H]),
    y = qruntime.ops.functional.rms_norm(residual_out, w, eps) with residual_out = x + residual (x
    itself when residual is None; x may be SplitKPartials, as in add_rmsnorm_quant)."""
    x, residual = _check(x, residual, w, max_block)
    tokens, hidden = x.shape
    y = torch.empty(tokens, hidden, dtype=w.dtype, device=x.device)
    residual_out = x if residual is None else torch.empty_like(residual, memory_format=torch.contiguous_format)
    _launch(x, residual, w, eps, residual_out, y, None, False, max_block, pdl)
    return y, residual_out
