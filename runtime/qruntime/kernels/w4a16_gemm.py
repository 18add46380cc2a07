"""W4A16 GEMM: y = x · dequant(w)ᵀ (the `W4A16Linear` op), int4 weights unpacked in registers.

x [M,K] bf16/fp16, rows contiguous; w int32 [N,K/8], eight 4-bit codes to a word along K, column j
of a row in bits 4 (j mod 8) of word j // 8 (compressed-tensors `pack-quantized`); ws [N,K/G] one
scale per row and group of G columns; optionally wz [N,K/G] uint8, one zero-point code per scale
(asymmetric int4). dequant(w)[n,k] = (code - z) * ws[n, k // G], z = wz[n, k // G] or 8 without
zero points (a constexpr switch: the symmetric kernel is unchanged), rounded to x's dtype as the
reference rounds it (qruntime.ops.functional.w4a16_linear: the weight is formed in the
model dtype, then a Gemm), then multiplied in fp32 on the tensor cores.

One program computes a [BLOCK_M, BLOCK_N] output tile over one K range. Per K tile it reads the
weight words [BLOCK_N, BLOCK_K/8] (BLOCK_K/2 bytes of each row), repeats each word 8 times along
K in registers (three interleaves: column j then holds word j // 8), shifts column j right by
4 (j mod 8) and masks, so column j holds its code; the code becomes a float exactly through its
bits (code | 0x4B000000 is the fp32 2^23 + code), minus 2^23 + 8 (or 2^23 + z) gives code - 8 (or
code - z). Times the group's
scale in fp32 (exact: 4 by 8 or 11 significant bits) and one rounding to the model dtype gives the
reference's weight to the bit; tl.dot with the x tile accumulates in fp32. A tile lies inside one
group (G a multiple of BLOCK_K: one scale per row) or holds whole groups (BLOCK_K a multiple of G).

Split-K (decode: streaming the weight is the whole cost): program (tile, s) writes the fp32 sum
over K range s to a workspace [split_k, M, N]; a second launch adds the partials in split order
(deterministic, as fp8_gemm's) and rounds once to the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qruntime.kernels.dynamic_quant import round_to, use_hw_casts
from qruntime.kernels.fp8_gemm import GemmConfig, grouped_tile, split_for
from qruntime.kernels.pdl import launch_options, wait_for_inputs

_DTYPES = (torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NUM_SMS_H100 = 132  # the heuristic's target; a tuner replaces it per device
PER_INT32 = 8  # int4 codes per packed word


@dataclass(frozen=True)
class W4A16Config(GemmConfig):
    """Launch configuration of w4a16_gemm (the JSON record of the tuner): the FP8 GEMM's fields."""

    def fits(self, group_size: int) -> bool:
        """Whether a K tile lies inside one group or holds whole groups."""
        return group_size % self.block_k == 0 or self.block_k % group_size == 0


def supports_group(group_size: int) -> bool:
    """Whether some K tile (a power of two >= 16) fits groups of `group_size` (a multiple of 8)."""
    return group_size > 0 and (group_size % 16 == 0 or 16 % group_size == 0)


def _block_k_for(block_k: int, group_size: int) -> int:
    """block_k, halved until it fits the groups (a power of two dividing G, or G dividing it)."""
    while block_k > 16 and group_size % block_k and block_k % group_size:
        block_k //= 2
    return block_k


def default_config(m: int, n: int, k: int, group_size: int = 128) -> W4A16Config:
    """Heuristic config per token-count bucket (H100-sized: 132 SMs).

    - m <= 16 (decode): streaming the N*K/2 weight bytes is the whole cost: 16-row tiles, K tiles
      of 256 (128 bytes of each weight row, one L2 line), 32 rows per program, 4 stages in flight,
      and split-K until the programs cover every SM (N=4096 at K=4096: 128 N tiles -> split 2).
    - m <= 64: 32/64 x 64 x 128 tiles, split-K only when the tiles fill less than half of the SMs.
    - larger: 64 (m <= 512) or 128 rows x 128 x 64, 8 warps: the unpacked [128, 64] weight tile
      in registers is the same size as the decode tile's, shared by more rows of x."""
    if m <= 16:
        bn, bk = 32, _block_k_for(256, group_size)
        return W4A16Config(16, bn, bk, split_for(triton.cdiv(n, bn), k, bk, _NUM_SMS_H100), 4, 4)
    if m <= 64:
        bm, bn, bk = (32 if m <= 32 else 64), 64, _block_k_for(128, group_size)
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        return W4A16Config(bm, bn, bk, split_for(tiles, k, bk, _NUM_SMS_H100 // 2 + 1), 4, 4)
    bk = _block_k_for(64, group_size)
    if m <= 512:
        return W4A16Config(64, 128, bk, 1, 4, 4)
    return W4A16Config(128, 128, bk, 1, 8, 3)


def sweep_configs(m: int, n: int, k: int, group_size: int = 128) -> list[W4A16Config]:
    """A small candidate list for the tuner to time at (m, n, k); default_config comes first, and
    every candidate fits `group_size`."""
    cands: list[W4A16Config] = [default_config(m, n, k, group_size)]
    if m <= 16:
        for bn, bk, warps, stages in (
            (16, 256, 4, 4),
            (32, 128, 4, 6),
            (32, 256, 4, 3),
            (64, 256, 4, 4),
            (32, 512, 8, 3),
            (64, 128, 4, 4),
        ):
            bk = _block_k_for(bk, group_size)
            tiles = triton.cdiv(n, bn)
            for target in (_NUM_SMS_H100, 2 * _NUM_SMS_H100):
                cands.append(W4A16Config(16, bn, bk, split_for(tiles, k, bk, target), warps, stages))
    elif m <= 512:
        bm = 32 if m <= 32 else 64
        for bn, bk, warps, stages in ((64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 5)):
            bk = _block_k_for(bk, group_size)
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            cands.append(W4A16Config(bm, bn, bk, 1, warps, stages))
            cands.append(W4A16Config(bm, bn, bk, split_for(tiles, k, bk, _NUM_SMS_H100), warps, stages))
    else:
        for bm, bn, bk, warps, stages in (
            (128, 128, 64, 8, 3),
            (128, 128, 128, 8, 3),
            (128, 256, 64, 8, 3),
            (64, 128, 64, 4, 4),
            (128, 64, 64, 4, 4),
        ):
            cands.append(W4A16Config(bm, bn, _block_k_for(bk, group_size), 1, warps, stages))
    return list(dict.fromkeys(cands))


@triton.jit
def _dequant_tile(words, scale, offset, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr):
    """int32 words [BN, BLOCK_K/8], fp32 scales and offsets 2^23 + z (each broadcastable to
    [BN, BLOCK_K]) -> the weight tile [BN, BLOCK_K], (code - z) * scale rounded once to DTYPE: in DTYPE
    on a GPU, as fp32 holding the DTYPE values under the interpreter (whose fp32 -> bf16 cast truncates)."""
    wide = tl.interleave(words, words)
    wide = tl.interleave(wide, wide)
    wide = tl.interleave(wide, wide)  # [BN, BLOCK_K]: column j holds word j // 8
    shifts = (tl.arange(0, BLOCK_K) % 8) * 4
    codes = (wide >> shifts[None, :]) & 0xF  # the arithmetic shift's sign bits are masked off
    q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - offset  # (2^23 + code) - (2^23 + z), exact
    w = q * scale  # exact in fp32
    if HW:
        return w.to(DTYPE)  # cvt.rn
    else:
        return round_to(w, DTYPE, HW)


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,  # [M, K] bf16 / fp16
    w_ptr,  # [N, K/8] int32
    s_ptr,  # [N, K/GROUP]
    z_ptr,  # [N, K/GROUP] uint8 zero-point codes (HAS_ZP only)
    c_ptr,  # [M, N] out dtype
    part_ptr,  # [SPLIT_K, M, N] fp32 (split-K only)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_cm,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    GROUP: tl.constexpr,  # columns per scale: a multiple of BLOCK_K, or BLOCK_K a multiple of it
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    HAS_ZP: tl.constexpr,  # zero points per group (asymmetric int4); else 8, symmetric
    HW: tl.constexpr,  # hardware rounding (the interpreter's fp32 -> bf16 cast truncates)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // 8)
    # rows past M are masked (never read); weight rows past N read row 0 instead (never stored)
    mask_m = (offs_m < M)[:, None]  # [BLOCK_M, 1]
    rn = tl.where(offs_n < N, offs_n, 0)

    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + (k_start // 8 + offs_kw)[None, :]  # [BLOCK_N, BLOCK_K/8]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m, other=0.0)
            words = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=mask_m & ((k + offs_k)[None, :] < K), other=0.0)
            words = tl.load(w_ptrs, mask=((k + offs_kw * 8) < K)[None, :], other=0)
        offset = 8388616.0  # 2^23 + 8: symmetric
        if BLOCK_K <= GROUP:  # the tile lies inside one group: one scale per row
            scale = tl.load(s_ptr + rn * stride_sn + k // GROUP).to(tl.float32)[:, None]  # [BLOCK_N, 1]
            if HAS_ZP:
                z = tl.load(z_ptr + rn * stride_zn + k // GROUP).to(tl.float32)[:, None]  # [BLOCK_N, 1]
                offset = z + 8388608.0
        else:  # whole groups: each row's BLOCK_K / GROUP scales, repeated over their columns
            offs_g = k // GROUP + tl.arange(0, BLOCK_K // GROUP)
            mask_g = (offs_g * GROUP < K)[None, :]
            s = tl.load(s_ptr + rn[:, None] * stride_sn + offs_g[None, :], mask=mask_g, other=0.0).to(tl.float32)
            scale = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
            if HAS_ZP:
                z = tl.load(z_ptr + rn[:, None] * stride_zn + offs_g[None, :], mask=mask_g, other=0).to(tl.float32)
                z = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
                offset = z + 8388608.0
        w = _dequant_tile(words, scale, offset, BLOCK_K, x_ptr.dtype.element_ty, HW)  # [BLOCK_N, BLOCK_K]
        if HW:  # noqa: SIM108 (two launch paths read better as branches in a kernel)
            acc = tl.dot(x, tl.trans(w), acc)  # fp32 accumulation
        else:  # the interpreter's dot of a loaded bf16 tile with a cast one is wrong: in fp32, the same products
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8

    mask_c = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K > 1:  # fp32 partial of K range pid_k; _splitk_sum_kernel adds them
        tl.store(part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask_c)
    else:
        y = round_to(acc, c_ptr.dtype.element_ty, HW)  # exact in the output dtype
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], y.to(c_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _splitk_sum_kernel(
    part_ptr,  # [SPLIT_K, M, N] fp32
    c_ptr,  # [M, N] out dtype, contiguous
    MN,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat index into [M, N]
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):  # split order: the result does not depend on scheduling
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    y = round_to(acc, c_ptr.dtype.element_ty, HW)
    tl.store(c_ptr + offs, y.to(c_ptr.dtype.element_ty), mask=mask)


def _check(
    x: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    group_size: int,
    out_dtype: torch.dtype,
    wz: torch.Tensor | None = None,
) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be bfloat16 or float16, got {x.dtype}")
    if w.dtype != torch.int32:
        raise ValueError(f"w must be int32 (8 int4 codes a word), got {w.dtype}")
    if x.dim() != 2 or w.dim() != 2 or ws.dim() != 2:
        raise ValueError(
            f"x [M,K], w [N,K/8] and ws [N,K/G] must be 2-D, got {tuple(x.shape)}, {tuple(w.shape)}, {tuple(ws.shape)}"
        )
    if not supports_group(group_size) or group_size % PER_INT32:
        raise ValueError(f"group_size must be a positive multiple of 16 (or 8), got {group_size}")
    (_, k), (n, words) = x.shape, w.shape
    if words * PER_INT32 != k:
        raise ValueError(f"x [M,K] and w [N,K/8] disagree on K: {tuple(x.shape)} vs {tuple(w.shape)}")
    if k % group_size or tuple(ws.shape) != (n, k // group_size):
        raise ValueError(f"ws must be [N, K/group_size] = [{n}, {k / group_size:g}], got {tuple(ws.shape)}")
    if not ws.is_floating_point():
        raise ValueError(f"ws must be a float tensor, got {ws.dtype}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if k > 0 and (x.stride(1) != 1 or w.stride(1) != 1 or ws.stride(1) != 1):
        raise ValueError(f"x, w and ws need contiguous rows, got strides {x.stride()}, {w.stride()}, {ws.stride()}")
    if wz is not None and (wz.dtype != torch.uint8 or wz.shape != ws.shape or (k > 0 and wz.stride(1) != 1)):
        raise ValueError(
            f"wz must be uint8 [N, K/group_size] like ws {tuple(ws.shape)} with contiguous rows, got {wz.dtype} "
            f"{tuple(wz.shape)}"
        )
    inputs = (x, w, ws) if wz is None else (x, w, ws, wz)
    if len({t.device for t in inputs}) != 1:
        raise ValueError(f"all inputs must be on one device, got {[str(t.device) for t in inputs]}")


def w4a16_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    group_size: int = 128,
    config: W4A16Config | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    pdl: bool = False,
    wz: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A16 linear: x [M,K] times the int4 weight w [N,K/8] with scales ws [N,K/group_size] (and
    zero-point codes wz, uint8 [N,K/group_size], when given: asymmetric int4), transposed -> [M,N]
    in out_dtype (default x's dtype; float32 gives the fp32 sum unrounded).

    x: bf16/fp16, rows contiguous; ws: any float dtype, cast to x's (the reference rounds the
    weight in x's dtype, with the scale in x's dtype). config: tile sizes, split-K and launch
    parameters; default_config(M, N, K, group_size) when None. pdl: programmatic dependent launch
    (kernels/pdl.py). Raises ValueError on a dtype, shape, stride or device mismatch, or a config
    whose K tile neither lies inside a group nor holds whole groups.
    """
    out_dtype = out_dtype or x.dtype
    _check(x, w, ws, group_size, out_dtype, wz)
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or default_config(m, n, k, group_size)
    if not cfg.fits(group_size):
        raise ValueError(f"block_k {cfg.block_k} neither divides nor is a multiple of group_size {group_size}")
    if ws.dtype != x.dtype:
        ws = ws.to(x.dtype)
    k_tiles = triton.cdiv(k, cfg.block_k)
    tiles_per_split = triton.cdiv(k_tiles, min(cfg.split_k, k_tiles))
    split = triton.cdiv(k_tiles, tiles_per_split)  # no empty split
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    hw = use_hw_casts(x)
    _w4a16_gemm_kernel[(tiles, split)](
        x,
        w,
        ws,
        ws if wz is None else wz,  # never read without zero points
        out,
        part,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        ws.stride(0),
        0 if wz is None else wz.stride(0),
        out.stride(0),
        tiles_per_split * cfg.block_k,
        GROUP=group_size,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        GROUP_M=8,
        EVEN_K=k % cfg.block_k == 0,
        HAS_ZP=wz is not None,
        HW=hw,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(pdl),
    )
    if split > 1:
        block = 1024
        _splitk_sum_kernel[(triton.cdiv(m * n, block),)](
            part, out, m * n, SPLIT_K=split, BLOCK=block, HW=hw, num_warps=4, **launch_options(pdl)
        )
    return out
