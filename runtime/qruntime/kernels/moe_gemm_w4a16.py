"""The fused MoE's grouped GEMMs for W4A16 experts (packed int4, group scales, optional zero points)
over moe_align's expert-grouped pair list: moe_gemm.py's programs and list, its FP8 operands
replaced by activations in the model dtype D and int4 weights unpacked in registers.

Experts as the `MoE` op with linear W4A16Linear reads them (compressed-tensors `pack-quantized`):
w13 int32 [E, 2I, H/8] (gate rows then up rows), w13_scale [E, 2I, H/G], w2 int32 [E, H, I/8],
w2_scale [E, H, I/G]; optionally uint8 zero-point codes shaped like the scales (w4a16-zp). Each
weight tile is unpacked as w4a16_gemm.py unpacks it (code | 0x4B000000 as a float, minus 2^23 + z,
z the zero point or 8, times the scale rounded to D, one rounding to D: the reference's weight to
the bit) and multiplied with the D activations, fp32 accumulation. The math per pair, in D, is the
reference op's (ops/moe.py over functional.w4a16_linear):
- up: h = D(x[t] · dequant(w13[e])ᵀ) (gate and up columns, two accumulators),
  act = D(D(g * D(sigmoid(g))) * u) stored in D at the pair's list position [max_padded, I];
- down: y = D(D(act[row] · dequant(w2[e])ᵀ) * D(routing weight)) at row p of out_pairs [T*k, H],
  which moe_combine adds up. No activation is quantized, so there is no row amax.
A K tile lies inside one group (one scale per row) or holds whole groups (fit_block_k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qruntime.kernels.activation import silu_times
from qruntime.kernels.dynamic_quant import round_to, use_hw_casts
from qruntime.kernels.moe_gemm import PairBlocks, _pair_rows, _tile_cols
from qruntime.kernels.pdl import launch_options, wait_for_inputs
from qruntime.kernels.w4a16_gemm import _dequant_tile

DTYPES = (torch.bfloat16, torch.float16)


def fit_block_k(block_k: int, group_size: int) -> int:
    """block_k halved until a K tile lies inside one group or holds whole groups (>= 16)."""
    while block_k > 16 and group_size % block_k and block_k % group_size:
        block_k //= 2
    if group_size % block_k and block_k % group_size:
        raise ValueError(f"no K tile of 16 or more fits int4 groups of {group_size}")
    return block_k


@triton.jit
def _int4_tile(
    w_ptrs,  # [BLOCK_N, BLOCK_K/8] the rows' words from column k on
    s_rows,  # [BLOCK_N] the rows' first scales
    z_rows,  # [BLOCK_N] the rows' first zero points (HAS_ZP only)
    k,
    K,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_ZP: tl.constexpr,
    DTYPE: tl.constexpr,
    HW: tl.constexpr,
):
    """The weight tile [BLOCK_N, BLOCK_K] of columns k.. of BLOCK_N int4 rows, dequantized and
    rounded to DTYPE (as fp32 holding DTYPE values under the interpreter: w4a16_gemm._dequant_tile)."""
    offs_kw = tl.arange(0, BLOCK_K // 8)
    if EVEN_K:  # noqa: SIM108 (constexpr branches read better in a kernel)
        words = tl.load(w_ptrs)
    else:
        words = tl.load(w_ptrs, mask=((k + offs_kw * 8) < K)[None, :], other=0)
    offset = 8388616.0  # 2^23 + 8: symmetric
    if BLOCK_K <= GROUP:  # inside one group: a scale per row
        scale = round_to(tl.load(s_rows + k // GROUP).to(tl.float32), DTYPE, HW)[:, None]
        if HAS_ZP:
            offset = tl.load(z_rows + k // GROUP).to(tl.float32)[:, None] + 8388608.0
    else:  # whole groups: each row's BLOCK_K / GROUP scales, repeated over their columns
        offs_g = k // GROUP + tl.arange(0, BLOCK_K // GROUP)
        mask_g = (offs_g * GROUP < K)[None, :]
        s = tl.load(s_rows[:, None] + offs_g[None, :], mask=mask_g, other=0.0).to(tl.float32)
        s = round_to(s, DTYPE, HW)
        scale = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
        if HAS_ZP:
            z = tl.load(z_rows[:, None] + offs_g[None, :], mask=mask_g, other=0).to(tl.float32)
            z = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
            offset = z + 8388608.0
    return _dequant_tile(words, scale, offset, BLOCK_K, DTYPE, HW)


@triton.jit
def _dot_w(a, w, acc, HW: tl.constexpr):
    """acc + a [BM, BK] · wᵀ (w [BN, BK]), fp32 accumulation of exact products."""
    if HW:
        return tl.dot(a, tl.trans(w), acc)
    else:  # the interpreter's dot of a loaded bf16 tile with a cast one is wrong: fp32, the same products
        return tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")


@triton.jit
def _int4_rows(
    w_ptr,
    s_ptr,
    z_ptr,
    expert,
    rn,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    BLOCK_K: tl.constexpr,
):
    """Expert `expert`'s weight rows rn: their first K tile's packed words [len(rn), BLOCK_K/8],
    and their scale and zero-point rows (for _int4_tile)."""
    w_ptrs = w_ptr + expert * stride_we + rn[:, None] * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
    s_rows = s_ptr + expert * stride_se + rn * stride_sn
    z_rows = z_ptr + expert * stride_ze + rn * stride_zn
    return w_ptrs, s_rows, z_rows


@triton.jit
def _moe_up_silu_w4a16_kernel(
    x_ptr,  # [T, H] model dtype, unit column stride
    w_ptr,  # [E, 2I, H/8] int32
    s_ptr,  # [E, 2I, H/G]
    z_ptr,  # [E, 2I, H/G] uint8 (HAS_ZP only)
    sorted_ptr,  # [max_padded] int32
    block_expert_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    act_ptr,  # [max_padded, I] model dtype, contiguous
    num_pairs,
    H,
    INTER,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    TOP_K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
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
    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs, gs, gz = _int4_rows(
        w_ptr, s_ptr, z_ptr, expert, rn, stride_we, stride_wn, stride_se, stride_sn, stride_ze, stride_zn, BLOCK_K
    )
    u_ptrs, us, uz = g_ptrs + INTER * stride_wn, gs + INTER * stride_sn, gz + INTER * stride_zn  # the up rows
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & ((k + offs_k) < H)[None, :], other=0.0)
        g = _int4_tile(g_ptrs, gs, gz, k, H, GROUP, BLOCK_N, BLOCK_K, EVEN_K, HAS_ZP, DTYPE, HW)
        acc_g = _dot_w(a, g, acc_g, HW)
        u = _int4_tile(u_ptrs, us, uz, k, H, GROUP, BLOCK_N, BLOCK_K, EVEN_K, HAS_ZP, DTYPE, HW)
        acc_u = _dot_w(a, u, acc_u, HW)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K // 8
        u_ptrs += BLOCK_K // 8

    act = silu_times(round_to(acc_g, DTYPE, HW), round_to(acc_u, DTYPE, HW), DTYPE, HW)  # h rounded to D first
    mask = valid[:, None] & (offs_n < INTER)[None, :]
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * INTER + offs_n[None, :], act.to(DTYPE), mask=mask)


@triton.jit
def _moe_down_w4a16_kernel(
    act_ptr,  # [max_padded, I] model dtype, contiguous
    w_ptr,  # [E, H, I/8] int32
    s_ptr,  # [E, H, I/G]
    z_ptr,  # [E, H, I/G] uint8 (HAS_ZP only)
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
    stride_ze,
    stride_zn,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    rows, pair, valid, _, expert = _pair_rows(sorted_ptr, block_expert_ptr, num_pairs, pid_m, BLOCK_M, 1)

    offs_n, rn = _tile_cols(pid_n, BLOCK_N, H)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * INTER + offs_k[None, :]
    w_ptrs, s_rows, z_rows = _int4_rows(
        w_ptr, s_ptr, z_ptr, expert, rn, stride_we, stride_wn, stride_se, stride_sn, stride_ze, stride_zn, BLOCK_K
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, INTER, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & ((k + offs_k) < INTER)[None, :], other=0.0)
        w = _int4_tile(w_ptrs, s_rows, z_rows, k, INTER, GROUP, BLOCK_N, BLOCK_K, EVEN_K, HAS_ZP, DTYPE, HW)
        acc = _dot_w(a, w, acc, HW)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8

    weight = round_to(tl.load(topk_w_ptr + pair, mask=valid, other=0.0), DTYPE, HW)[:, None]
    y = round_to(round_to(acc, DTYPE, HW) * weight, DTYPE, HW)
    mask = valid[:, None] & (offs_n < H)[None, :]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * H + offs_n[None, :], y.to(DTYPE), mask=mask)


def check_int4_experts(
    name: str, w: torch.Tensor, ws: torch.Tensor, wz: torch.Tensor | None, rows: int, cols: int, group_size: int
) -> None:
    """ValueError naming the tensor unless w is int32 [E, rows, cols/8], ws float [E, rows, cols/G]
    and wz (when given) uint8 like ws, each with contiguous rows."""
    if w.dtype != torch.int32 or w.dim() != 3 or tuple(w.shape[1:]) != (rows, cols // 8) or w.stride(2) != 1:
        raise ValueError(
            f"{name} must be int32 [E, {rows}, {cols // 8}] (8 int4 codes a word) with contiguous rows, got "
            f"{w.dtype} {tuple(w.shape)}"
        )
    groups = (w.shape[0], rows, cols // group_size)
    if cols % group_size or not ws.is_floating_point() or tuple(ws.shape) != groups or ws.stride(2) != 1:
        raise ValueError(
            f"{name}_scale must be float {list(groups)} (group {group_size}), got {ws.dtype} {tuple(ws.shape)}"
        )
    if wz is not None and (wz.dtype != torch.uint8 or tuple(wz.shape) != groups or wz.stride(2) != 1):
        raise ValueError(
            f"{name}_zero_point must be uint8 {list(groups)} like its scales, got {wz.dtype} {tuple(wz.shape)}"
        )


def _grid(blocks: PairBlocks, n: int, block_n: int) -> tuple[int, int]:
    return blocks.sorted_ids.numel() // blocks.block_m, triton.cdiv(n, block_n)


def _zp_args(ws: torch.Tensor, wz: torch.Tensor | None) -> tuple[torch.Tensor, int, int]:
    """The zero points and their strides (the scales, never read, without them)."""
    return (ws, 0, 0) if wz is None else (wz, wz.stride(0), wz.stride(1))


def moe_up_silu_w4a16(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    blocks: PairBlocks,
    group_size: int,
    *,
    w13_zp: torch.Tensor | None = None,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    pdl: bool = False,
) -> torch.Tensor:
    """act [max_padded, I] (x's dtype; rows of padding positions unspecified) = silu_mul of each
    pair's up projection x[t] · dequant(w13[e])ᵀ. x [T, H] bf16 / fp16; w13 int32 [E, 2I, H/8],
    w13_scale [E, 2I, H/G], w13_zp uint8 like the scale or None (symmetric: code - 8)."""
    if x.dtype not in DTYPES or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be bfloat16 or float16 [T, H] with contiguous rows, got {x.dtype} {tuple(x.shape)}")
    tokens, hidden = x.shape
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, H/8], got {tuple(w13.shape)}")
    inter = w13.shape[1] // 2
    check_int4_experts("w13", w13, w13_scale, w13_zp, 2 * inter, hidden, group_size)
    if blocks.num_pairs != tokens * blocks.top_k:
        raise ValueError(f"the pair list is of {blocks.num_pairs} pairs, not T*k = {tokens}*{blocks.top_k}")
    block_k = fit_block_k(block_k, group_size)
    act = torch.empty(blocks.sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    zp, stride_ze, stride_zn = _zp_args(w13_scale, w13_zp)
    _moe_up_silu_w4a16_kernel[_grid(blocks, inter, block_n)](
        x, w13, w13_scale, zp, blocks.sorted_ids, blocks.block_expert, blocks.num_padded, act,
        blocks.num_pairs, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), stride_ze, stride_zn,
        TOP_K=blocks.top_k, GROUP=group_size, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=hidden % block_k == 0, HAS_ZP=w13_zp is not None, HW=use_hw_casts(x),
        num_warps=num_warps, num_stages=num_stages, **launch_options(pdl),
    )  # fmt: skip
    return act


def moe_down_w4a16(
    act: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    blocks: PairBlocks,
    group_size: int,
    *,
    w2_zp: torch.Tensor | None = None,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    pdl: bool = False,
) -> torch.Tensor:
    """out_pairs [T*k, H] (act's dtype): row p = D(D(act[row of p] · dequant(w2[e])ᵀ) * D(weight of p)).
    act [max_padded, I] from moe_up_silu_w4a16, w2 int32 [E, H, I/8], w2_scale [E, H, I/G], w2_zp
    uint8 like the scale or None, topk_weights [T, k] fp32."""
    inter = act.shape[1]
    if w2.dim() != 3:
        raise ValueError(f"w2 must be [E, H, I/8], got {tuple(w2.shape)}")
    hidden = w2.shape[1]
    check_int4_experts("w2", w2, w2_scale, w2_zp, hidden, inter, group_size)
    if act.dtype not in DTYPES or act.shape[0] != blocks.sorted_ids.numel() or not act.is_contiguous():
        raise ValueError(f"act must be the contiguous [max_padded, I] of moe_up_silu_w4a16, got {tuple(act.shape)}")
    if topk_weights.dtype != torch.float32 or topk_weights.numel() != blocks.num_pairs:
        raise ValueError(f"topk_weights must be float32 [T, k] of {blocks.num_pairs} pairs, got {topk_weights.dtype}")
    block_k = fit_block_k(block_k, group_size)
    out = torch.empty(blocks.num_pairs, hidden, dtype=act.dtype, device=act.device)
    zp, stride_ze, stride_zn = _zp_args(w2_scale, w2_zp)
    _moe_down_w4a16_kernel[_grid(blocks, hidden, block_n)](
        act, w2, w2_scale, zp, blocks.sorted_ids, blocks.block_expert, blocks.num_padded,
        topk_weights.contiguous(), out, blocks.num_pairs, hidden, inter, w2.stride(0), w2.stride(1),
        w2_scale.stride(0), w2_scale.stride(1), stride_ze, stride_zn,
        GROUP=group_size, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=inter % block_k == 0, HAS_ZP=w2_zp is not None, HW=use_hw_casts(act),
        num_warps=num_warps, num_stages=num_stages, **launch_options(pdl),
    )  # fmt: skip
    return out
