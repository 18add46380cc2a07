"""The fused MoE's expert projections for a single token (batch-1 decode) as GEMVs (steps 3-4).

One token routes to k distinct experts, so each projection is k matrix-vector products. The grouped
GEMMs of moe_gemm.py run them as 16-row tensor-core tiles with one real row, a pipelined K loop and
the pair list of moe_align; here a program takes BLOCK_N weight rows of one slot's expert and all
of K, its K steps unrolled (NUM_K constexpr) so that every weight load is in flight at once, and
multiplies on the CUDA cores (fp8 codes widened to fp32: each product is exact, sums in fp32). At
one token the weight bytes are the whole cost and the unrolled loads reach more of the bandwidth:
measured with bench/moe_decode_kernels.py on an H100 (f81ec31, CUDA graphs, k = 8, other experts
each call) against the best grouped config, the up projection took 10.95 against 12.91 µs at
qwen3-30b-a3b tp = 1, 4.52 against 8.36 at tp = 4 (I = 192) and 10.57 against 13.70 at
qwen3-235b-a22b tp = 4; the down projection 7.09 against 9.85, 3.39 against 5.73, 7.49 against 9.68.

The math per slot s (expert e = topk_ids[0, s]) is the grouped GEMMs', in the model dtype D:
- up: h = D(xq · w13[e]ᵀ · xs · ws) for the gate and up rows, act[s] = D(D(g * D(sigmoid(g))) * u);
- down: act[s] quantized per token (scale max(max|act[s]| / 448, 1e-12), dynamic_quant's codes bit
  for bit; each program takes the row's max itself), y = D(D(codes · w2[e]ᵀ · scale · ws) *
  D(weight s)) at row s of out_pairs [k, H], which moe_combine adds up in slot order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
from qruntime.kernels.fp8_gemm import gemv_steps
from qruntime.kernels.moe_gemm import _tile_cols
from qruntime.kernels.pdl import launch_options, wait_for_inputs

_TILE_KEYS = ("block_n", "block_k", "num_warps")
_GEMVS = ("up", "down")


@dataclass(frozen=True)
class GemvTile:
    """Launch parameters of one one-token projection: weight rows and K per step of a program."""

    block_n: int
    block_k: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.block_n < 1 or self.block_n & (self.block_n - 1) or self.block_n > 256:
            raise ValueError(f"block_n must be a power of two in 1..256, got {self.block_n}")
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 16, got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two <= 16, got {self.num_warps}")


@dataclass(frozen=True)
class MoEGemvConfig:
    """Launch configuration of the fused MoE at one token on the GEMV path (fused_moe.py)."""

    up: GemvTile  # N = I (gate and up rows), K = H
    down: GemvTile  # N = H, K = I

    def to_dict(self) -> dict[str, int]:
        """Flat JSON record: gemv 1, up_block_n, ..., down_num_warps."""
        out = {"gemv": 1}
        for gemv in _GEMVS:
            out.update({f"{gemv}_{key}": getattr(getattr(self, gemv), key) for key in _TILE_KEYS})
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoEGemvConfig:
        """Inverse of to_dict (other keys, such as a tuner's timings, are ignored)."""
        try:
            return cls(**{g: GemvTile(**{k: int(d[f"{g}_{k}"]) for k in _TILE_KEYS}) for g in _GEMVS})
        except KeyError as exc:
            raise ValueError(f"MoE GEMV config {dict(d)} lacks {exc}") from None


def default_gemv_config(inter: int, hidden: int, top_k: int) -> MoEGemvConfig:
    """Measured on an H200 (qwen3-30b-a3b at tp 1 and 4, qwen3-235b-a22b at tp 4): the up projection
    fastest at about 768 programs (k * I / block_n) of 1024-wide K steps (512 above H = 2048), the
    down projection at 128-wide K steps (64 where I is not a multiple of 128) of 16-32 rows."""
    up_n = max(1, min(16, triton.next_power_of_2(max(1, top_k * inter // 768))))
    up = GemvTile(up_n, 1024 if hidden <= 2048 else 512, 2 if hidden <= 2048 else 4)
    down = GemvTile(16 if inter >= 768 else 32, 128 if inter % 128 == 0 else 64, 2 if inter >= 768 else 4)
    return MoEGemvConfig(up, down)


def gemv_sweep(inter: int, hidden: int, top_k: int) -> list[MoEGemvConfig]:
    """Candidates for the tuner at one token; default_gemv_config first."""
    default = default_gemv_config(inter, hidden, top_k)
    ups = [default.up] + [GemvTile(n, k, w) for n, k, w in ((2, 1024, 2), (4, 512, 4), (8, 1024, 2), (8, 512, 4))]
    downs = [default.down] + [GemvTile(n, k, w) for n, k, w in ((8, 128, 2), (32, 64, 4), (32, 128, 4))]
    cands = [default] + [MoEGemvConfig(u, default.down) for u in ups] + [MoEGemvConfig(default.up, d) for d in downs]
    return list(dict.fromkeys(cands))


@triton.jit
def _moe_up_one_kernel(
    xq_ptr,  # [1, H] fp8
    xs_ptr,  # [1, 1] fp32
    w_ptr,  # [E, 2I, H] fp8, H contiguous
    ws_ptr,  # [E, 2I, 1]
    ids_ptr,  # [1, k] int32
    act_ptr,  # [k, I] model dtype, contiguous
    H,
    INTER,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    NUM_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    slot = tl.program_id(0)
    DTYPE: tl.constexpr = act_ptr.dtype.element_ty
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    offs_n, rn = _tile_cols(tl.program_id(1), BLOCK_N, INTER)
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + expert * stride_we + rn[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for step in tl.static_range(NUM_K):
        k = step * BLOCK_K
        if EVEN_K:
            x = tl.load(xq_ptr + k + offs_k).to(tl.float32)
            g = tl.load(g_ptrs + k).to(tl.float32)
            u = tl.load(u_ptrs + k).to(tl.float32)
        else:
            in_k = k + offs_k < H
            x = tl.load(xq_ptr + k + offs_k, mask=in_k, other=0.0).to(tl.float32)
            g = tl.load(g_ptrs + k, mask=in_k[None, :], other=0.0).to(tl.float32)
            u = tl.load(u_ptrs + k, mask=in_k[None, :], other=0.0).to(tl.float32)
        acc_g += g * x[None, :]
        acc_u += u * x[None, :]
    xs = tl.load(xs_ptr)
    s_e = ws_ptr + expert * stride_se
    g = round_to(tl.sum(acc_g, axis=1) * xs * tl.load(s_e + rn * stride_sn).to(tl.float32), DTYPE, HW)
    u = round_to(tl.sum(acc_u, axis=1) * xs * tl.load(s_e + (rn + INTER) * stride_sn).to(tl.float32), DTYPE, HW)
    act = silu_times(g, u, DTYPE, HW)
    tl.store(act_ptr + slot * INTER + offs_n, act.to(DTYPE), mask=offs_n < INTER)


@triton.jit
def _moe_down_one_kernel(
    act_ptr,  # [k, I] model dtype, contiguous
    w_ptr,  # [E, H, I] fp8, I contiguous
    ws_ptr,  # [E, H, 1]
    ids_ptr,  # [1, k] int32
    topk_w_ptr,  # [1, k] fp32 routing weights
    out_ptr,  # [k, H] model dtype, contiguous
    H,
    INTER,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    NUM_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_I: tl.constexpr,  # next_power_of_2(I): the act row as one tile, for its max
    EVEN_K: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    FNUZ: tl.constexpr = False,  # w2 in e4m3fnuz (amd-gfx942): act quantized to it, its scale doubled
):
    wait_for_inputs(PDL)
    slot = tl.program_id(0)
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    act_row = act_ptr + slot * INTER
    # dynamic_quant's per-token scale of the act row, taken by every program from the whole row
    cols = tl.arange(0, BLOCK_I)
    amax = tl.max(tl.abs(tl.load(act_row + cols, mask=cols < INTER, other=0.0).to(tl.float32)), axis=0)
    scale = quant_scale(amax)
    inv_scale = tl.math.div_rn(1.0, scale)

    offs_n, rn = _tile_cols(tl.program_id(1), BLOCK_N, H)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + expert * stride_we + rn[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for step in tl.static_range(NUM_K):
        k = step * BLOCK_K
        if EVEN_K:
            a = tl.load(act_row + k + offs_k).to(tl.float32)
            w = tl.load(w_ptrs + k).to(tl.float32)
        else:
            in_k = k + offs_k < INTER
            a = tl.load(act_row + k + offs_k, mask=in_k, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs + k, mask=in_k[None, :], other=0.0).to(tl.float32)
        codes = fp8_values(fp8_e4m3_code(a, scale, inv_scale, HW, FNUZ), FNUZ).to(tl.float32)
        acc += w * codes[None, :]
    ws = tl.load(ws_ptr + expert * stride_se + rn * stride_sn).to(tl.float32)
    down = round_to(tl.sum(acc, axis=1) * fp8_scale(scale, FNUZ) * ws, DTYPE, HW)
    y = round_to(down * round_to(tl.load(topk_w_ptr + slot), DTYPE, HW), DTYPE, HW)
    tl.store(out_ptr + slot * H + offs_n, y.to(DTYPE), mask=offs_n < H)


def _check_one(name: str, w: torch.Tensor, ws: torch.Tensor, rows: int, cols: int) -> None:
    if w.dtype not in FP8_FORMATS or w.dim() != 3 or tuple(w.shape[1:]) != (rows, cols) or w.stride(2) != 1:
        raise ValueError(
            f"{name} must be float8_e4m3fn or float8_e4m3fnuz [E, {rows}, {cols}] with contiguous rows, got "
            f"{w.dtype} {tuple(w.shape)}"
        )
    if ws.dtype not in (torch.bfloat16, torch.float16, torch.float32) or tuple(ws.shape) != (w.shape[0], rows, 1):
        raise ValueError(f"{name}_scale must be bf16/fp16/fp32 [E, {rows}, 1], got {ws.dtype} {tuple(ws.shape)}")


def _check_ids(topk_ids: torch.Tensor) -> int:
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2 or topk_ids.shape[0] != 1 or not topk_ids.is_contiguous():
        raise ValueError(
            f"topk_ids must be one token's contiguous int32 [1, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    return topk_ids.shape[1]


def moe_up_one(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    out_dtype: torch.dtype,
    tile: GemvTile,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """act [k, I] (out_dtype): row s = silu_mul of the PTPC up projection of the one token by expert
    topk_ids[0, s]. xq [1, H] fp8, xs [1, 1] fp32, w13 [E, 2I, H] fp8 (xq's format: e4m3fn, or
    e4m3fnuz for amd-gfx942), w13_scale [E, 2I, 1]."""
    if xq.dtype not in FP8_FORMATS or xq.dim() != 2 or xq.shape[0] != 1 or xq.stride(1) != 1:
        raise ValueError(
            f"xq must be one token's float8_e4m3fn or float8_e4m3fnuz [1, H], got {xq.dtype} {tuple(xq.shape)}"
        )
    if xs.dtype != torch.float32 or xs.numel() != 1:
        raise ValueError(f"xs must be one float32 scale, got {xs.dtype} {tuple(xs.shape)}")
    hidden = xq.shape[1]
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, H], got {tuple(w13.shape)}")
    inter = w13.shape[1] // 2
    _check_one("w13", w13, w13_scale, 2 * inter, hidden)
    if w13.dtype != xq.dtype:
        raise ValueError(f"xq and w13 must be of one FP8 format (the target's), got {xq.dtype} and {w13.dtype}")
    top_k = _check_ids(topk_ids)
    act = torch.empty(top_k, inter, dtype=out_dtype, device=xq.device)
    block_k, steps = gemv_steps(hidden, tile.block_k)
    _moe_up_one_kernel[(top_k, triton.cdiv(inter, tile.block_n))](
        xq, xs, w13, w13_scale, topk_ids, act, hidden, inter,
        w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        NUM_K=steps, BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0,
        HW=use_hw_casts(xq), num_warps=tile.num_warps, **launch_options(pdl),
    )  # fmt: skip
    return act


def moe_down_one(
    act: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tile: GemvTile,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """out_pairs [k, H] (act's dtype): row s = D(D(PTPC down projection of act[s], quantized per
    token, by expert topk_ids[0, s]) * D(topk_weights[0, s])). act [k, I] from moe_up_one,
    w2 [E, H, I] fp8, w2_scale [E, H, 1], topk_weights [1, k] fp32. w2 float8_e4m3fnuz (amd-gfx942,
    its scales doubled): act quantized to e4m3fnuz, its scale doubled."""
    top_k = _check_ids(topk_ids)
    if act.dim() != 2 or act.shape[0] != top_k or not act.is_contiguous():
        raise ValueError(f"act must be the contiguous [k, I] of moe_up_one (k = {top_k}), got {tuple(act.shape)}")
    inter = act.shape[1]
    if w2.dim() != 3:
        raise ValueError(f"w2 must be [E, H, I], got {tuple(w2.shape)}")
    hidden = w2.shape[1]
    _check_one("w2", w2, w2_scale, hidden, inter)
    if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (1, top_k):
        raise ValueError(f"topk_weights must be float32 [1, {top_k}], got {topk_weights.dtype}")
    out = torch.empty(top_k, hidden, dtype=act.dtype, device=act.device)
    block_k, steps = gemv_steps(inter, tile.block_k)
    _moe_down_one_kernel[(top_k, triton.cdiv(hidden, tile.block_n))](
        act, w2, w2_scale, topk_ids, topk_weights.contiguous(), out, hidden, inter,
        w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        NUM_K=steps, BLOCK_N=tile.block_n, BLOCK_K=block_k, BLOCK_I=triton.next_power_of_2(inter),
        EVEN_K=inter % block_k == 0, HW=use_hw_casts(act), FNUZ=w2.dtype == torch.float8_e4m3fnuz,
        num_warps=tile.num_warps, **launch_options(pdl),
    )  # fmt: skip
    return out
