"""The fused MoE's grouped FP8 GEMMs over the expert-grouped pair list of moe_align (steps 3-4).

Program (b, n) of a GEMM takes block b of the list (BLOCK_M positions of one expert, block_expert[b])
and output columns [n*BLOCK_N, (n+1)*BLOCK_N); blocks at or past num_padded return at once. Rows
hold pairs p = t * k + s (sentinel T*k: padding, read as zeros, never stored). The math per pair is
the reference op's (ops/moe.py: PTPC linears on per-token FP8 activations, in the model dtype D):
- up (w13 [E, 2I, H], gate rows then up rows): xq[t] · w13[e]ᵀ as two fp32 accumulators (gate and
  the matching up columns), each times xs[t] * ws[col] and rounded to D (h, the PTPC linear output),
  act = D(D(g * D(sigmoid(g))) * u) (functional.silu_mul), stored in D at the pair's list position
  [max_padded, I]; |act|'s row maximum goes to row_amax by atomic_max across the column programs.
- down (w2 [E, H, I]): the act row quantized to e4m3 on load with s = max(row_amax / 448, 1e-12)
  (bit for bit dynamic_quant's per-token quantization of that row), fp8 dot, times s * ws,
  rounded to D, times the routing weight rounded to D (the reference's weights are in D), rounded,
  and stored at row p of out_pairs [T*k, H] (moe_combine.py adds each token's k rows).
Each output row depends on its own operands only, never on its position in a block, so the order
moe_align gives the pairs within an expert does not change the results.

On Hopper, tiles of >= 64 rows run wgmma, whose fp8 products are added at reduced precision: as in
fp8_gemm.py, the partial sum is promoted to the fp32 accumulator every ACC_PROMOTE_K of K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qruntime.kernels.activation import silu_times
from qruntime.kernels.dynamic_quant import (
    FP8_FORMATS,
    fp8_e4m3_code,
    fp8_scale,
    fp8_values,
    quant_scale,
    round_to,
    use_hw_casts,
)
from qruntime.kernels.fp8_gemm import _ACC_PROMOTE_K
from qruntime.kernels.pdl import launch_options, wait_for_inputs


@dataclass(frozen=True)
class PairBlocks:
    """moe_align's grouped list of one step (all device tensors, shapes fixed by T)."""

    sorted_ids: torch.Tensor  # [max_padded] int32
    block_expert: torch.Tensor  # [max_blocks] int32
    num_padded: torch.Tensor  # [1] int32
    row_amax: torch.Tensor  # [max_padded] fp32, zero before the up projection
    block_m: int
    top_k: int
    num_pairs: int  # T * k, also the sentinel


@triton.jit
def _pair_rows(sorted_ptr, block_expert_ptr, num_pairs, pid_m, BLOCK_M: tl.constexpr, TOP_K: tl.constexpr):
    """Block pid_m of moe_align's list: its list positions, their pairs, which of them are real
    (the rest pad the block), each pair's token (int64, 0 for padding; the down GEMMs read act rows
    by list position, pass TOP_K 1 and leave it unused) and the block's expert (int64). The caller
    exits first when the block lies past num_padded."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # list positions
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    token = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    return rows, pair, valid, token, expert


@triton.jit
def _tile_cols(pid_n, BLOCK_N: tl.constexpr, N):
    """Output columns of tile pid_n, and the weight rows they read: those past N read row 0 (never stored)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.where(offs_n < N, offs_n, 0)
    return offs_n, rn


@triton.jit
def _moe_up_silu_kernel(
    xq_ptr,  # [T, H] fp8
    xs_ptr,  # [T, 1] fp32
    w_ptr,  # [E, 2I, H] fp8, H contiguous
    ws_ptr,  # [E, 2I, 1]
    sorted_ptr,  # [max_padded] int32
    block_expert_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    act_ptr,  # [max_padded, I] model dtype, contiguous
    amax_ptr,  # [max_padded] fp32
    num_pairs,
    H,
    INTER,
    stride_xm,
    stride_xs,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ACC_PROMOTE_K: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    DTYPE: tl.constexpr = act_ptr.dtype.element_ty
    rows, pair, valid, token, expert = _pair_rows(sorted_ptr, block_expert_ptr, num_pairs, pid_m, BLOCK_M, TOP_K)

    offs_n, rn = _tile_cols(pid_n, BLOCK_N, INTER)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = xq_ptr + token[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_e = w_ptr + expert * stride_we
    g_ptrs = w_e + rn[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N], K-major
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            in_k = (k + offs_k) < H
            a = tl.load(a_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=in_k[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=in_k[:, None], other=0.0)
        acc_g = tl.dot(a, g, acc_g, max_num_imprecise_acc=ACC_PROMOTE_K)
        acc_u = tl.dot(a, u, acc_u, max_num_imprecise_acc=ACC_PROMOTE_K)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K

    xs = tl.load(xs_ptr + token * stride_xs, mask=valid, other=0.0)[:, None]  # [BLOCK_M, 1]
    s_e = ws_ptr + expert * stride_se
    ws_g = tl.load(s_e + rn * stride_sn).to(tl.float32)[None, :]
    ws_u = tl.load(s_e + (rn + INTER) * stride_sn).to(tl.float32)[None, :]
    g = round_to(acc_g * xs * ws_g, DTYPE, HW)  # the PTPC linear's output h, in the model dtype
    u = round_to(acc_u * xs * ws_u, DTYPE, HW)
    act = silu_times(g, u, DTYPE, HW)
    mask = valid[:, None] & (offs_n < INTER)[None, :]
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * INTER + offs_n[None, :], act.to(DTYPE), mask=mask)
    tl.atomic_max(amax_ptr + rows, tl.max(tl.where(mask, tl.abs(act), 0.0), axis=1), mask=valid)


@triton.jit
def _moe_down_kernel(
    act_ptr,  # [max_padded, I] model dtype, contiguous
    amax_ptr,  # [max_padded] fp32
    w_ptr,  # [E, H, I] fp8, I contiguous
    ws_ptr,  # [E, H, 1]
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    topk_w_ptr,  # [T*k] fp32 routing weights
    out_ptr,  # [T*k, H] model dtype, contiguous
    num_pairs,
    H,
    INTER,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ACC_PROMOTE_K: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    FNUZ: tl.constexpr = False,  # w2 in e4m3fnuz (amd-gfx942): act quantized to it, its scale doubled
):
    wait_for_inputs(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    rows, pair, valid, _, expert = _pair_rows(sorted_ptr, block_expert_ptr, num_pairs, pid_m, BLOCK_M, 1)
    # dynamic_quant's per-token scale of each act row
    scale = quant_scale(tl.load(amax_ptr + rows, mask=valid, other=0.0))[:, None]  # [BLOCK_M, 1]
    inv_scale = tl.math.div_rn(1.0, scale)

    offs_n, rn = _tile_cols(pid_n, BLOCK_N, H)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * INTER + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + rn[None, :] * stride_wn + offs_k[:, None]  # K-major
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, INTER, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            in_k = (k + offs_k) < INTER
            a = tl.load(a_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_k[:, None], other=0.0)
        aq = fp8_values(fp8_e4m3_code(a.to(tl.float32), scale, inv_scale, HW, FNUZ), FNUZ)
        acc = tl.dot(aq, b, acc, max_num_imprecise_acc=ACC_PROMOTE_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    ws = tl.load(ws_ptr + expert * stride_se + rn * stride_sn).to(tl.float32)[None, :]
    down = round_to(acc * fp8_scale(scale, FNUZ) * ws, DTYPE, HW)
    weight = round_to(tl.load(topk_w_ptr + pair, mask=valid, other=0.0), DTYPE, HW)[:, None]
    y = round_to(down * weight, DTYPE, HW)
    mask = valid[:, None] & (offs_n < H)[None, :]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * H + offs_n[None, :], y.to(DTYPE), mask=mask)


def _check_weights(name: str, w: torch.Tensor, ws: torch.Tensor, rows: int, cols: int) -> None:
    if w.dtype not in FP8_FORMATS or w.dim() != 3 or tuple(w.shape[1:]) != (rows, cols):
        raise ValueError(
            f"{name} must be float8_e4m3fn or float8_e4m3fnuz [E, {rows}, {cols}], got {w.dtype} {tuple(w.shape)}"
        )
    if w.stride(2) != 1:
        raise ValueError(f"{name} needs contiguous rows (stride 1 along its last dim), got strides {w.stride()}")
    if ws.dtype not in (torch.bfloat16, torch.float16, torch.float32) or tuple(ws.shape) != (w.shape[0], rows, 1):
        raise ValueError(f"{name}_scale must be bf16/fp16/fp32 [E, {rows}, 1], got {ws.dtype} {tuple(ws.shape)}")


def _grid(blocks: PairBlocks, n: int, block_n: int) -> tuple[int, int]:
    return blocks.sorted_ids.numel() // blocks.block_m, triton.cdiv(n, block_n)


def moe_up_silu(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    blocks: PairBlocks,
    out_dtype: torch.dtype,
    *,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    pdl: bool = False,
) -> torch.Tensor:
    """act [max_padded, I] (out_dtype; rows of padding positions unspecified) = silu_mul of each
    pair's PTPC up projection xq[t] · w13[e]ᵀ, and blocks.row_amax[row] = max |act[row]|.
    xq [T, H] fp8, xs [T, 1] fp32, w13 [E, 2I, H] fp8 (xq's format: e4m3fn, or e4m3fnuz for
    amd-gfx942), w13_scale [E, 2I, 1]."""
    if xq.dtype not in FP8_FORMATS or xq.dim() != 2 or xq.stride(1) != 1:
        raise ValueError(
            f"xq must be float8_e4m3fn or float8_e4m3fnuz [T, H] with contiguous rows, got {xq.dtype} {tuple(xq.shape)}"
        )
    tokens, hidden = xq.shape
    if xs.dtype != torch.float32 or tuple(xs.shape) != (tokens, 1):
        raise ValueError(f"xs must be float32 [T, 1] = [{tokens}, 1], got {xs.dtype} {tuple(xs.shape)}")
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, H], got {tuple(w13.shape)}")
    inter = w13.shape[1] // 2
    _check_weights("w13", w13, w13_scale, 2 * inter, hidden)
    if w13.dtype != xq.dtype:
        raise ValueError(f"xq and w13 must be of one FP8 format (the target's), got {xq.dtype} and {w13.dtype}")
    if blocks.num_pairs != tokens * blocks.top_k:
        raise ValueError(f"the pair list is of {blocks.num_pairs} pairs, not T*k = {tokens}*{blocks.top_k}")
    act = torch.empty(blocks.sorted_ids.numel(), inter, dtype=out_dtype, device=xq.device)
    _moe_up_silu_kernel[_grid(blocks, inter, block_n)](
        xq,
        xs,
        w13,
        w13_scale,
        blocks.sorted_ids,
        blocks.block_expert,
        blocks.num_padded,
        act,
        blocks.row_amax,
        blocks.num_pairs,
        hidden,
        inter,
        xq.stride(0),
        xs.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale.stride(0),
        w13_scale.stride(1),
        TOP_K=blocks.top_k,
        BLOCK_M=blocks.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=hidden % block_k == 0,
        ACC_PROMOTE_K=min(_ACC_PROMOTE_K, block_k),
        HW=use_hw_casts(xq),
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(pdl),
    )
    return act


def moe_down(
    act: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    blocks: PairBlocks,
    *,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    pdl: bool = False,
) -> torch.Tensor:
    """out_pairs [T*k, H] (act's dtype): row p = D(D(down projection of pair p) * D(weight of p)),
    the down projection being PTPC on act's row quantized per token (scale from blocks.row_amax).
    act [max_padded, I] from moe_up_silu, w2 [E, H, I] fp8, w2_scale [E, H, 1], topk_weights [T, k] fp32.
    w2 float8_e4m3fnuz (amd-gfx942, its scales doubled): act quantized to e4m3fnuz, its scale doubled."""
    inter = act.shape[1]
    if w2.dim() != 3:
        raise ValueError(f"w2 must be [E, H, I], got {tuple(w2.shape)}")
    hidden = w2.shape[1]
    _check_weights("w2", w2, w2_scale, hidden, inter)
    if act.shape[0] != blocks.sorted_ids.numel() or not act.is_contiguous():
        raise ValueError(f"act must be the contiguous [max_padded, I] of moe_up_silu, got {tuple(act.shape)}")
    if topk_weights.dtype != torch.float32 or topk_weights.numel() != blocks.num_pairs:
        raise ValueError(f"topk_weights must be float32 [T, k] of {blocks.num_pairs} pairs, got {topk_weights.dtype}")
    out = torch.empty(blocks.num_pairs, hidden, dtype=act.dtype, device=act.device)
    _moe_down_kernel[_grid(blocks, hidden, block_n)](
        act,
        blocks.row_amax,
        w2,
        w2_scale,
        blocks.sorted_ids,
        blocks.block_expert,
        blocks.num_padded,
        topk_weights.contiguous(),
        out,
        blocks.num_pairs,
        hidden,
        inter,
        w2.stride(0),
        w2.stride(1),
        w2_scale.stride(0),
        w2_scale.stride(1),
        BLOCK_M=blocks.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=inter % block_k == 0,
        ACC_PROMOTE_K=min(_ACC_PROMOTE_K, block_k),
        HW=use_hw_casts(act),
        FNUZ=w2.dtype == torch.float8_e4m3fnuz,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(pdl),
    )
    return out
