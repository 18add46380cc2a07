"""The fused MoE's expert projections for a single token (batch-1 decode) with W4A16 experts, as
GEMVs: moe_gemv.py's programs (BLOCK_N weight rows of one slot's expert, all of K in NUM_K unrolled
steps, products on the CUDA cores, fp32 sums) reading int4 weights unpacked in registers as
moe_gemm_w4a16.py does (each weight the reference's, rounded to the model dtype D).

The math per slot s (expert e = topk_ids[0, s]), in D:
- up: h = D(x · dequant(w13[e])ᵀ) for the gate and up rows, act[s] = D(D(g * D(sigmoid(g))) * u);
- down: y = D(D(act[s] · dequant(w2[e])ᵀ) * D(weight s)) at row s of out_pairs [k, H] (moe_combine
  adds them in slot order). The activations stay in D (nothing is quantized).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qruntime.kernels.activation import silu_times
from qruntime.kernels.dynamic_quant import round_to, use_hw_casts
from qruntime.kernels.fp8_gemm import gemv_steps
from qruntime.kernels.moe_gemm import _tile_cols
from qruntime.kernels.moe_gemm_w4a16 import DTYPES, _int4_rows, _int4_tile, _zp_args, check_int4_experts, fit_block_k
from qruntime.kernels.moe_gemv import GemvTile, _check_ids
from qruntime.kernels.pdl import launch_options, wait_for_inputs


@triton.jit
def _moe_up_one_w4a16_kernel(
    x_ptr,  # [1, H] model dtype
    w_ptr,  # [E, 2I, H/8] int32
    s_ptr,  # [E, 2I, H/G]
    z_ptr,  # [E, 2I, H/G] uint8 (HAS_ZP only)
    ids_ptr,  # [1, k] int32
    act_ptr,  # [k, I] model dtype, contiguous
    H,
    INTER,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    GROUP: tl.constexpr,
    NUM_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    slot = tl.program_id(0)
    DTYPE: tl.constexpr = act_ptr.dtype.element_ty
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    offs_n, rn = _tile_cols(tl.program_id(1), BLOCK_N, INTER)
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs, gs, gz = _int4_rows(
        w_ptr, s_ptr, z_ptr, expert, rn, stride_we, stride_wn, stride_se, stride_sn, stride_ze, stride_zn, BLOCK_K
    )
    u_ptrs, us, uz = g_ptrs + INTER * stride_wn, gs + INTER * stride_sn, gz + INTER * stride_zn  # the up rows
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for step in tl.static_range(NUM_K):
        k = step * BLOCK_K
        if EVEN_K:
            x = tl.load(x_ptr + k + offs_k).to(tl.float32)
        else:
            x = tl.load(x_ptr + k + offs_k, mask=k + offs_k < H, other=0.0).to(tl.float32)
        g = _int4_tile(g_ptrs + k // 8, gs, gz, k, H, GROUP, BLOCK_N, BLOCK_K, EVEN_K, HAS_ZP, DTYPE, HW)
        u = _int4_tile(u_ptrs + k // 8, us, uz, k, H, GROUP, BLOCK_N, BLOCK_K, EVEN_K, HAS_ZP, DTYPE, HW)
        acc_g += g.to(tl.float32) * x[None, :]
        acc_u += u.to(tl.float32) * x[None, :]
    g = round_to(tl.sum(acc_g, axis=1), DTYPE, HW)
    u = round_to(tl.sum(acc_u, axis=1), DTYPE, HW)
    act = silu_times(g, u, DTYPE, HW)
    tl.store(act_ptr + slot * INTER + offs_n, act.to(DTYPE), mask=offs_n < INTER)


@triton.jit
def _moe_down_one_w4a16_kernel(
    act_ptr,  # [k, I] model dtype, contiguous
    w_ptr,  # [E, H, I/8] int32
    s_ptr,  # [E, H, I/G]
    z_ptr,  # [E, H, I/G] uint8 (HAS_ZP only)
    ids_ptr,  # [1, k] int32
    topk_w_ptr,  # [1, k] fp32 routing weights
    out_ptr,  # [k, H] model dtype, contiguous
    H,
    INTER,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    GROUP: tl.constexpr,
    NUM_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    slot = tl.program_id(0)
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    act_row = act_ptr + slot * INTER
    offs_n, rn = _tile_cols(tl.program_id(1), BLOCK_N, H)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs, s_rows, z_rows = _int4_rows(
        w_ptr, s_ptr, z_ptr, expert, rn, stride_we, stride_wn, stride_se, stride_sn, stride_ze, stride_zn, BLOCK_K
    )
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for step in tl.static_range(NUM_K):
        k = step * BLOCK_K
        if EVEN_K:
            a = tl.load(act_row + k + offs_k).to(tl.float32)
        else:
            a = tl.load(act_row + k + offs_k, mask=k + offs_k < INTER, other=0.0).to(tl.float32)
        w = _int4_tile(w_ptrs + k // 8, s_rows, z_rows, k, INTER, GROUP, BLOCK_N, BLOCK_K, EVEN_K, HAS_ZP, DTYPE, HW)
        acc += w.to(tl.float32) * a[None, :]
    down = round_to(tl.sum(acc, axis=1), DTYPE, HW)
    y = round_to(down * round_to(tl.load(topk_w_ptr + slot), DTYPE, HW), DTYPE, HW)
    tl.store(out_ptr + slot * H + offs_n, y.to(DTYPE), mask=offs_n < H)


def _steps(k: int, block_k: int, group_size: int) -> tuple[int, int]:
    """(block_k, unrolled steps) of a GEMV over K whose tiles fit the int4 groups."""
    block_k = fit_block_k(gemv_steps(k, block_k)[0], group_size)
    return block_k, triton.cdiv(k, block_k)


def moe_up_one_w4a16(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    group_size: int,
    tile: GemvTile,
    *,
    w13_zp: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """act [k, I] (x's dtype): row s = silu_mul of the one token's up projection by expert
    topk_ids[0, s]. x [1, H] bf16 / fp16, w13 int32 [E, 2I, H/8], w13_scale [E, 2I, H/G], w13_zp
    uint8 like the scale or None."""
    if x.dtype not in DTYPES or x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        raise ValueError(f"x must be one token's bfloat16 or float16 [1, H], got {x.dtype} {tuple(x.shape)}")
    hidden = x.shape[1]
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, H/8], got {tuple(w13.shape)}")
    inter = w13.shape[1] // 2
    check_int4_experts("w13", w13, w13_scale, w13_zp, 2 * inter, hidden, group_size)
    top_k = _check_ids(topk_ids)
    act = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    block_k, steps = _steps(hidden, tile.block_k, group_size)
    zp, stride_ze, stride_zn = _zp_args(w13_scale, w13_zp)
    _moe_up_one_w4a16_kernel[(top_k, triton.cdiv(inter, tile.block_n))](
        x, w13, w13_scale, zp, topk_ids, act, hidden, inter, w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), stride_ze, stride_zn,
        GROUP=group_size, NUM_K=steps, BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0,
        HAS_ZP=w13_zp is not None, HW=use_hw_casts(x), num_warps=tile.num_warps, **launch_options(pdl),
    )  # fmt: skip
    return act


def moe_down_one_w4a16(
    act: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    group_size: int,
    tile: GemvTile,
    *,
    w2_zp: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """out_pairs [k, H] (act's dtype): row s = D(D(act[s] · dequant(w2[e])ᵀ) * D(topk_weights[0, s])),
    e = topk_ids[0, s]. act [k, I] from moe_up_one_w4a16, w2 int32 [E, H, I/8], w2_scale [E, H, I/G],
    w2_zp uint8 like the scale or None, topk_weights [1, k] fp32."""
    top_k = _check_ids(topk_ids)
    if act.dtype not in DTYPES or act.dim() != 2 or act.shape[0] != top_k or not act.is_contiguous():
        raise ValueError(f"act must be the contiguous [k, I] of moe_up_one_w4a16 (k = {top_k}), got {tuple(act.shape)}")
    inter = act.shape[1]
    if w2.dim() != 3:
        raise ValueError(f"w2 must be [E, H, I/8], got {tuple(w2.shape)}")
    hidden = w2.shape[1]
    check_int4_experts("w2", w2, w2_scale, w2_zp, hidden, inter, group_size)
    if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (1, top_k):
        raise ValueError(f"topk_weights must be float32 [1, {top_k}], got {topk_weights.dtype}")
    out = torch.empty(top_k, hidden, dtype=act.dtype, device=act.device)
    block_k, steps = _steps(inter, tile.block_k, group_size)
    zp, stride_ze, stride_zn = _zp_args(w2_scale, w2_zp)
    _moe_down_one_w4a16_kernel[(top_k, triton.cdiv(hidden, tile.block_n))](
        act, w2, w2_scale, zp, topk_ids, topk_weights.contiguous(), out, hidden, inter,
        w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), stride_ze, stride_zn,
        GROUP=group_size, NUM_K=steps, BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN_K=inter % block_k == 0,
        HAS_ZP=w2_zp is not None, HW=use_hw_casts(act), num_warps=tile.num_warps, **launch_options(pdl),
    )  # fmt: skip
    return out
