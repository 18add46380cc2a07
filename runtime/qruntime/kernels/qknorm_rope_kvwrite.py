"""Fused per-head QK RMSNorm + NeoX RoPE + KV-cache write (the `QKNormRoPEKVWrite` op).

qkv [T, (nh + 2·kvh)·d] is split into q, k, v heads; q and k get a per-head RMSNorm over d (fp32
math, cast to the model dtype, times the weight [d]) and rotate-half RoPE (inv_freq = theta^(-2i/d),
angle = position · inv_freq in fp32, applied in fp32, cast to the model dtype); k and v go to the
layer's K/V block pools at slot_mapping[t] (fp8 pools store fp8(clamp(x / scale, ±448))), and q
[T, nh, d] is returned. The reference is qruntime.ops.attention.QKNormRoPEKVWrite.

Grid (T, (nh + kvh) / HEADS): program (t, g) handles HEADS consecutive heads of token t, all q heads
or all k heads (HEADS divides nh and kvh), a k head together with its v head. HEADS = 1 is one
program per (token, head), the decode configuration (few programs, latency-bound: the most
parallelism, no host work beyond the cached pool addressing, no host sync); larger steps group
heads, which shares the RoPE angles of the token and makes fewer, wider CTAs (a one-warp CTA cannot
fill an SM: 32 CTAs at most); _launch_config picks HEADS and num_warps by T (measured on an H100). A head is a [2, d/2] tile (row 0 the first half of the head dim, row 1
the second), and RoPE's rotate-half partner is a second load of the same (cached) row with the
halves swapped, so no cross-lane shuffle is needed and the d/2 angles broadcast over both rows.
With mrope_section (Qwen3-VL) positions are [3, T] and the d/2 angles read each frequency's row
(one vector load of the token's column instead of a scalar load); the angle arithmetic is unchanged.

Pools are addressed by kv_addressing.pool_addressing (8 integers per pool, one formula for nhd, hnd
and x-packed); the two split sizes (token-offset split, head-dim split) are constexpr, so `//` and
`%` by them compile to shifts. A negative slot skips the write (padding rows).

Rounding follows the torch reference operation by operation, so results are bit-identical up to
the order of the sum of squares (and, natively, fp32 contraction into FMAs and libdevice's sin/cos):
the RMS factor is 1 / sqrt(mean + eps) with IEEE sqrt and division (torch.rsqrt on the CPU),
inv_freq = 1 / fp32(theta ** e) with e = fp32(2i / d) (the power in fp64, rounded once, which is
what a correctly rounded powf gives), fp8 is fp8(clamp(x / scale)) with the IEEE quotient (Markstein:
x · (1/scale) corrected by one FMA). Roundings to bf16 and fp8 are dynamic_quant's round_to and
fp8_e4m3_code: the hardware's conversions natively, integer emulation under the interpreter (whose
fp32 -> bf16 cast truncates and whose fp32 -> fp8 cast mis-rounds).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from qruntime.kernels.dynamic_quant import FP8_FORMATS, fp8_e4m3_code, round_to, use_hw_casts
from qruntime.kernels.fp8_gemm import SplitKPartials, check_partials, splitk_value
from qruntime.kernels.kv_addressing import PoolAddressing, pool_addressing, pool_offsets
from qruntime.kernels.pdl import launch_options, wait_for_inputs
from qruntime.kv_layout import KVLayout

_MODEL_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _store_kv(pool_ptr, offsets, x, mask, scale, FP8: tl.constexpr, HW: tl.constexpr, FNUZ: tl.constexpr):
    """Store x (fp32 holding a model-dtype value) to the pool; fp8 pools (a uint8 view) get the bytes
    of fp8(clamp(x / scale, ±448)) with the IEEE quotient, as torch computes it (FNUZ: as e4m3fnuz,
    e4m3fn's codes with -0 as 0, which the attention kernels read at twice the scale)."""
    if FP8:
        scale = tl.cast(scale, tl.float32)
        tl.store(pool_ptr + offsets, fp8_e4m3_code(x, scale, tl.math.div_rn(1.0, scale), HW, FNUZ), mask=mask)
    else:
        tl.store(pool_ptr + offsets, x.to(pool_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qkv(
    row_ptr, cols, mask, xs_ptr, ws_ptr, t, T, stride_xs, stride_ws,
    WIDTH: tl.constexpr, SPLIT: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """Elements `cols` of token t's qkv row, fp32: loaded from row_ptr, or (SPLIT > 0) from the
    split-K qkv GEMM's partials at row_ptr (their base then), reduced here with its scales."""
    if SPLIT == 0:
        return tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        return splitk_value(row_ptr, xs_ptr, ws_ptr, t, cols, mask, T, WIDTH, stride_xs, stride_ws, SPLIT, DTYPE, HW)


@triton.jit
def _norm_rope(
    row_ptr, col0, w_ptr, dim, partner, sign, mask, cos, sin, eps, xs_ptr, ws_ptr, t, T, stride_xs, stride_ws,
    D: tl.constexpr, WIDTH: tl.constexpr, SPLIT: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """RMSNorm then rotate-half RoPE of heads [HEADS, 2, HALF_PAD] whose columns of token t's qkv
    row start at col0 [HEADS, 1, 1] (read as _qkv reads them): fp32 values rounded to the model dtype."""
    a = _qkv(row_ptr, col0 + dim, mask, xs_ptr, ws_ptr, t, T, stride_xs, stride_ws, WIDTH, SPLIT, DTYPE, HW)
    ap = _qkv(row_ptr, col0 + partner, mask, xs_ptr, ws_ptr, t, T, stride_xs, stride_ws, WIDTH, SPLIT, DTYPE, HW)
    w = tl.load(w_ptr + dim, mask=mask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    # torch: rsqrt(x.pow(2).mean(-1) + eps) on fp32 = 1 / sqrt(sum / d + eps), IEEE division and sqrt
    ss = tl.sum(tl.sum(a * a, 2), 1)[:, None, None]  # [HEADS, 1, 1]
    ms = tl.math.div_rn(ss, tl.full(ss.shape, D, tl.float32)) + eps
    r = tl.math.div_rn(tl.full(ss.shape, 1.0, tl.float32), tl.sqrt_rn(ms))
    # weight * normed.to(dtype): the product of two bf16/fp16 values is exact in fp32, then rounded once
    y = round_to(round_to(a * r, DTYPE, HW) * w, DTYPE, HW)
    yp = round_to(round_to(ap * r, DTYPE, HW) * wp, DTYPE, HW)
    return round_to(y * cos + (sign * yp) * sin, DTYPE, HW)  # x * cos + rotate_half(x) * sin


@triton.jit
def _qknorm_rope_kvwrite_kernel(
    qkv_ptr,  # [T, (NH + 2 KVH) * D] model dtype, unit last stride; SPLIT: the qkv GEMM's fp32 partials
    q_norm_w_ptr,  # [D]
    k_norm_w_ptr,  # [D]
    pos_ptr,  # [T] int, or MROPE: [3, T] (rows t, h, w at pos_row_stride)
    slot_ptr,  # [T] int
    q_ptr,  # [T, NH, D] out, contiguous
    k_pool_ptr,
    v_pool_ptr,
    qkv_stride,
    pos_stride,
    pos_row_stride,
    slot_stride,
    eps,
    theta,
    k_scale,
    v_scale,
    xs_ptr,  # SPLIT: the qkv GEMM's scales xs [T, 1], ws [(NH + 2 KVH) * D, 1]
    ws_ptr,
    T,
    stride_xs,
    stride_ws,
    # K pool addressing (kv_addressing.PoolAddressing; the splits are constexpr below)
    k_s_block,
    k_s_head,
    k_s_tok_outer,
    k_s_tok_inner,
    k_s_dim_outer,
    k_s_dim_inner,
    # V pool addressing
    v_s_block,
    v_s_head,
    v_s_tok_outer,
    v_s_tok_inner,
    v_s_dim_outer,
    v_s_dim_inner,
    K_TOK_SPLIT: tl.constexpr,
    K_DIM_SPLIT: tl.constexpr,
    V_TOK_SPLIT: tl.constexpr,
    V_DIM_SPLIT: tl.constexpr,
    NH: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    HALF_PAD: tl.constexpr,  # next power of two >= D // 2
    HEADS: tl.constexpr,  # heads per program, a power of two dividing NH and KVH
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    FP8: tl.constexpr,
    HW: tl.constexpr,  # hardware fp32 -> bf16 / e4m3 conversions (not under the interpreter)
    MROPE: tl.constexpr,  # interleaved M-RoPE: frequency j reads its position from row 0, 1 or 2
    S_H: tl.constexpr,  # MROPE: mrope_section[1], frequencies 1, 4, .. < 3 S_H read row 1
    S_W: tl.constexpr,  # MROPE: mrope_section[2], frequencies 2, 5, .. < 3 S_W read row 2
    SPLIT: tl.constexpr,  # 0: qkv_ptr is qkv itself
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    FNUZ: tl.constexpr = False,  # FP8: e4m3fnuz pools (amd-gfx942)
):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * HEADS  # first head of the program: q heads 0..NH-1, then k heads
    HALF: tl.constexpr = D // 2
    hh = tl.arange(0, HEADS)[:, None, None]  # [HEADS, 1, 1]
    half = tl.arange(0, 2)[None, :, None]  # [1, 2, 1] which half of the head dim
    j = tl.arange(0, HALF_PAD)[None, None, :]  # [1, 1, HALF_PAD] index within the half
    dim = half * HALF + j  # [1, 2, HALF_PAD] head-dim index
    partner = (1 - half) * HALF + j  # rotate-half partner: x[dim] pairs with x[partner]
    sign = tl.where(half == 0, -1.0, 1.0)  # rotate_half(x) = [-x2, x1]
    mask = (j < HALF) & (half < 2) & (hh < HEADS)  # [HEADS, 2, HALF_PAD]

    # RoPE angles as torch computes them: e = fp32(2j / d), inv_freq = 1 / fp32(theta ** e),
    # angle = fp32(position) * inv_freq, all [1, 1, HALF_PAD]
    if (D & (D - 1)) == 0:
        e = j.to(tl.float32) * (2.0 / D)  # exact: 2 / D is a power of two
    else:
        e = tl.math.div_rn((2 * j).to(tl.float32), tl.full(j.shape, D, tl.float32))
    p = tl.exp2(e.to(tl.float64) * tl.log2(tl.cast(theta, tl.float64))).to(tl.float32)
    inv_freq = tl.math.div_rn(tl.full(p.shape, 1.0, tl.float32), p)
    if MROPE:  # transformers' apply_interleaved_mrope: each frequency's row of positions
        row_of = tl.where((j % 3 == 1) & (j < 3 * S_H), 1, tl.where((j % 3 == 2) & (j < 3 * S_W), 2, 0))
        pos = tl.load(pos_ptr + row_of.to(tl.int64) * pos_row_stride + t * pos_stride, mask=j < HALF, other=0)
    else:
        pos = tl.load(pos_ptr + t * pos_stride)
    angle = pos.to(tl.float32) * inv_freq
    cos = tl.cos(angle)
    sin = tl.sin(angle)

    DTYPE: tl.constexpr = q_norm_w_ptr.dtype.element_ty
    WIDTH: tl.constexpr = (NH + 2 * KVH) * D
    row = qkv_ptr + t * qkv_stride  # qkv_stride 0 with SPLIT: the partials' base
    if h0 < NH:
        h = h0 + hh
        out = _norm_rope(
            row, h * D, q_norm_w_ptr, dim, partner, sign, mask, cos, sin, eps,
            xs_ptr, ws_ptr, t, T, stride_xs, stride_ws, D, WIDTH, SPLIT, DTYPE, HW,
        )  # fmt: skip
        tl.store(q_ptr + (t * NH + h) * D + dim, out.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        hk = h0 - NH + hh  # kv heads
        slot = tl.load(slot_ptr + t * slot_stride).to(tl.int64)
        v = _qkv(
            row, (NH + KVH + hk) * D + dim, mask, xs_ptr, ws_ptr, t, T, stride_xs, stride_ws, WIDTH, SPLIT, DTYPE, HW
        )
        out = _norm_rope(
            row, (NH + hk) * D, k_norm_w_ptr, dim, partner, sign, mask, cos, sin, eps,
            xs_ptr, ws_ptr, t, T, stride_xs, stride_ws, D, WIDTH, SPLIT, DTYPE, HW,
        )  # fmt: skip
        if slot >= 0:  # a negative slot (padding) writes nothing
            block = slot // BLOCK_SIZE
            tok = slot % BLOCK_SIZE
            k_off = pool_offsets(
                block, tok, hk, dim, k_s_block, k_s_head, k_s_tok_outer, k_s_tok_inner,
                k_s_dim_outer, k_s_dim_inner, K_TOK_SPLIT, K_DIM_SPLIT,
            )  # fmt: skip
            _store_kv(k_pool_ptr, k_off, out, mask, k_scale, FP8, HW, FNUZ)
            v_off = pool_offsets(
                block, tok, hk, dim, v_s_block, v_s_head, v_s_tok_outer, v_s_tok_inner,
                v_s_dim_outer, v_s_dim_inner, V_TOK_SPLIT, V_DIM_SPLIT,
            )  # fmt: skip
            _store_kv(v_pool_ptr, v_off, v, mask, v_scale, FP8, HW, FNUZ)


# (max tokens, heads per program, num_warps), from sweeps on an H100 at qwen3-8b shapes (CUDA-graph
# timings; bench/gpu_kernels/qknorm_rope.py times the result). Beyond the last row: one warp and
# _LARGE_HEADS[(x-packed, fp8)] heads, fewer for x-packed, whose scattered V stores want more CTAs.
_CONFIGS = ((16, 1, 4), (32, 2, 4), (96, 2, 2), (192, 4, 2))
_LARGE_HEADS = {(False, False): 8, (False, True): 8, (True, False): 4, (True, True): 2}


def _launch_config(tokens: int, num_heads: int, num_kv_heads: int, x_packed: bool, fp8: bool) -> tuple[int, int]:
    """(heads per program, num_warps) for a step of `tokens` tokens.

    Decode: one program per (token, head) with a value per thread (the shortest dependency chain,
    the most parallelism). Larger steps group heads (sharing the token's RoPE angles, fewer CTAs);
    the group is capped by the largest power of two dividing both head counts."""
    g = math.gcd(num_heads, num_kv_heads)
    heads, warps = next(((h, w) for limit, h, w in _CONFIGS if tokens <= limit), (_LARGE_HEADS[x_packed, fp8], 1))
    return min(heads, g & -g), warps


@functools.lru_cache(maxsize=256)
def _addressing(
    dims: tuple[str, ...], shape: tuple[int, ...], strides: tuple[int, ...], block_size: int, head_dim: int
) -> PoolAddressing:
    return pool_addressing(dims, shape, strides, block_size, head_dim)


def _check_section(section: tuple[int, int, int], head_dim: int) -> None:
    """ValueError unless section is three non-negative integers summing to head_dim / 2."""
    ok = isinstance(section, (tuple, list)) and len(section) == 3
    ok = ok and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)
    if not ok or sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section must be 3 non-negative integers summing to {head_dim // 2}, got {section!r}")


def qknorm_rope_kvwrite(
    qkv: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    theta: float,
    layout: KVLayout,
    block_size: int,
    k_scale: float,
    v_scale: float,
    heads_per_program: int | None = None,
    num_warps: int | None = None,
    pdl: bool = False,
    mrope_section: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Per-head RMSNorm + RoPE of q and k, k and v written to one layer's cache; returns q.

    qkv [T, (num_heads + 2·num_kv_heads)·head_dim] (model dtype, bf16 or fp16; rows may be strided),
    q_norm_w / k_norm_w [head_dim] (model dtype), positions / slot_mapping [T] integer. k_pool /
    v_pool are one layer's pools as KVCache allocates them in `layout` (model dtype, or
    float8_e4m3fn for an fp8 cache, which stores fp8(clamp(x / scale, ±448)) with k_scale /
    v_scale; or float8_e4m3fnuz, amd-gfx942's, holding the same codes with -0 as 0, which the
    attention kernels read at twice k_scale / v_scale). The pools are updated in place at each token's slot (block slot // block_size,
    offset slot % block_size); a negative slot writes nothing. Returns q [T, num_heads, head_dim]
    in the model dtype. One launch, no host synchronisation.

    heads_per_program / num_warps override the launch configuration (None: by T, _launch_config);
    heads_per_program must be a power of two dividing num_heads and num_kv_heads. pdl: programmatic
    dependent launch (kernels/pdl.py). qkv may be the qkv GEMM's SplitKPartials (fp8_gemm.py),
    reduced in this launch.

    mrope_section (Qwen3-VL's interleaved M-RoPE, [s_t, s_h, s_w] summing to head_dim / 2): positions
    is then [3, T] (any strides): rotary frequency j takes its position from row 1 when j mod 3 = 1 and
    j < 3·s_h, from row 2 when j mod 3 = 2 and j < 3·s_w, else from row 0; the angle arithmetic is
    the plain path's.
    """
    nh, kvh, d = num_heads, num_kv_heads, head_dim
    split = isinstance(qkv, SplitKPartials)
    if split:
        check_partials(qkv, None, q_norm_w)
    if len(qkv.shape) != 2 or qkv.shape[1] != (nh + 2 * kvh) * d:
        raise ValueError(f"qkv must be [T, {(nh + 2 * kvh) * d}] for {nh}+2x{kvh} heads of {d}, got {tuple(qkv.shape)}")
    if qkv.dtype not in _MODEL_DTYPES:
        raise ValueError(f"qkv dtype must be bf16 or fp16, got {qkv.dtype}")
    if not split and qkv.stride(1) != 1:
        raise ValueError("qkv must have a unit last stride")
    if d < 2 or d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    for name, w in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
        if w.shape != (d,) or w.dtype != qkv.dtype or w.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous [{d}] {qkv.dtype} tensor, got {tuple(w.shape)} {w.dtype}")
    t = qkv.shape[0]
    if mrope_section is not None:
        _check_section(mrope_section, d)
    pos_shape = (t,) if mrope_section is None else (3, t)
    for name, x, shape in (("positions", positions, pos_shape), ("slot_mapping", slot_mapping, (t,))):
        if x.shape != shape or x.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be an int64/int32 {list(shape)} tensor, got {tuple(x.shape)} {x.dtype}")
    fp8 = k_pool.dtype in FP8_FORMATS
    if v_pool.dtype != k_pool.dtype or not (fp8 or k_pool.dtype == qkv.dtype):
        raise ValueError(
            f"pools must both be float8_e4m3fn, both float8_e4m3fnuz or both {qkv.dtype}, got {k_pool.dtype} / "
            f"{v_pool.dtype}"
        )
    kv_dtype = "fp8_e4m3" if fp8 else "bf16"  # layout shapes depend only on the element size
    layout.check(block_size, d, kv_dtype)
    k_shape, v_shape = layout.shapes(k_pool.shape[0], block_size, kvh, d, kv_dtype)
    if tuple(k_pool.shape) != k_shape or tuple(v_pool.shape) != v_shape:
        raise ValueError(
            f"pools {tuple(k_pool.shape)} / {tuple(v_pool.shape)} do not match layout {layout.name}: {k_shape} / {v_shape}"
        )
    for x in (positions, slot_mapping, q_norm_w, k_norm_w, k_pool, v_pool):
        if x.device != qkv.device:
            raise ValueError(f"all tensors must be on {qkv.device}, got one on {x.device}")

    q = torch.empty((t, nh, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    heads, warps = _launch_config(t, nh, kvh, layout.name == "x-packed", fp8)
    heads, warps = heads_per_program or heads, num_warps or warps
    if heads & (heads - 1) or nh % heads or kvh % heads:
        raise ValueError(f"heads_per_program must be a power of two dividing {nh} and {kvh}, got {heads}")
    ka = _addressing(layout.k_dims, k_shape, tuple(k_pool.stride()), block_size, d)
    va = _addressing(layout.v_dims, v_shape, tuple(v_pool.stride()), block_size, d)
    pools = (k_pool.view(torch.uint8), v_pool.view(torch.uint8)) if fp8 else (k_pool, v_pool)
    part, xs, ws, _, stride_xs, stride_ws = qkv.kernel_args() if split else (qkv, q, q, t, 0, 0)
    _qknorm_rope_kvwrite_kernel[(t, (nh + kvh) // heads)](
        part, q_norm_w, k_norm_w, positions, slot_mapping, q, *pools,
        0 if split else qkv.stride(0), positions.stride(-1), positions.stride(0), slot_mapping.stride(0),
        eps, theta, k_scale, v_scale, xs, ws, t, stride_xs, stride_ws,
        ka.block, ka.head, ka.tok_outer, ka.tok_inner, ka.dim_outer, ka.dim_inner,
        va.block, va.head, va.tok_outer, va.tok_inner, va.dim_outer, va.dim_inner,
        K_TOK_SPLIT=ka.tok_split, K_DIM_SPLIT=ka.dim_split, V_TOK_SPLIT=va.tok_split, V_DIM_SPLIT=va.dim_split,
        NH=nh, KVH=kvh, D=d, HALF_PAD=triton.next_power_of_2(d // 2), HEADS=heads,
        BLOCK_SIZE=block_size, FP8=fp8, HW=use_hw_casts(q), SPLIT=qkv.split if split else 0, num_warps=warps,
        FNUZ=k_pool.dtype == torch.float8_e4m3fnuz, MROPE=mrope_section is not None, S_H=(mrope_section or (0, 0, 0))[1], S_W=(mrope_section or (0, 0, 0))[2],
        **launch_options(pdl),
    )  # fmt: skip
    return q
