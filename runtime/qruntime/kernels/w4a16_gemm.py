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

Swapped tiles (W4A16Config.swap_ab): the same tile computed as yᵀ = w · xᵀ, the unpacked weight
tile the dot's first operand, the accumulator stored transposed. Its 64+ weight rows fill the
tensor-core instruction's M side at any token count, and on Hopper wgmma may take that operand
from registers. Measured on an H200 (qwen3-8b shapes, the tuner's timing): the default at 2-16
tokens (16 x 64 x 256: qkv 22.5 -> 15.9 µs at 16 tokens) and from 513 (256 x 128 x 64, 8 warps:
1024 tokens, qkv 160 -> 149 µs, o 98 -> 76, gate_up 563 -> 451, down 298 -> 246).

Split-K (decode: streaming the weight is the whole cost): program (tile, s) writes the fp32 sum
over K range s to a workspace [split_k, M, N]; a second launch adds the partials in split order
(deterministic, as fp8_gemm's) and rounds once to the output dtype.

One token runs by default as a GEMV (W4A16Config block_m 1, _w4a16_gemv_kernel, after
fp8_gemm's): a program takes BLOCK_N weight rows and all of K, its K steps unrolled so their loads
are in flight together, no tensor cores, products in fp32, summed per column then across (another
order than the tiles'), no split-K. With PDL it first asks L2 for its weight rows (the weights do
not depend on the previous kernel). At one token the work is the unpacking, not the dot, and so
ops per weight byte decide its speed: in bf16 on a GPU (FAST) _dequant_pairs_bf16 makes two
columns' weights per instruction: (word >> 4j) & 0x000F000F | 0x43004300 is the bf16 pair
(128 + code_j, 128 + code_j+4), exact; a bf16x2 FMA subtracts 128 + z (exact, a small integer) and
one multiplies by the scale, rounding the exact product once, as the reference's bf16 multiply
does; each half is then an fp32 (its bits the fp32's top half) for the FMA with x. About 4 ops a
weight against the fp32 unpacking's ~8 (which fp16 keeps: an fp16 -> fp32 conversion costs a cvt).
Tiles may unpack the same way (W4A16Config.packed: the pairs laid out as the tile by
_bf16_tile, the same weights to the bit): not yet timed on a GPU, so only the tuner picks it.
The GEMV on an H200 (PDL, CUDA graphs, weights past L2; % of 4.27 TB/s copy bandwidth): qkv 8.8 µs (35%), o 6.2
(33%), gate_up 25.6 (48%), down 19.3 (32%), against the former 16-row tile default's 22.5 / 14.2
/ 58.5 / 35.7 (timed at 16 tokens, which it ran as fast as one: bench/results, c95e7ce, H100).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from qruntime.kernels.dynamic_quant import round_bf16, round_to, use_hw_casts
from qruntime.kernels.fp8_gemm import (
    GEMV_PREFETCH_ALL,
    MAX_GEMV_PREFETCH,
    MAX_GEMV_UNROLL,
    GemmConfig,
    grouped_tile,
    split_for,
)
from qruntime.kernels.pdl import launch_options, prefetch_l2, wait_for_inputs

_DTYPES = (torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NUM_SMS_H100 = 132  # the heuristic's target; a tuner replaces it per device
PER_INT32 = 8  # int4 codes per packed word


@dataclass(frozen=True)
class W4A16Config(GemmConfig):
    """Launch configuration of w4a16_gemm (the JSON record of the tuner): the FP8 GEMM's fields
    (block_m 1: the one-token GEMV, validated as the FP8 GEMV's), and swap_ab: 1 computes each
    tile transposed (yᵀ = w · xᵀ), so the unpacked weight tile is the tensor-core dot's first
    operand (on Hopper, wgmma reads it from registers; the tile's 64+ weight rows fill the
    instruction's M side at any token count), 0 the plain x · wᵀ; packed: 1 unpacks a bf16 tile
    with _dequant_pairs_bf16 (two columns an instruction, as the bf16 GEMV always does; the same
    weights to the bit), 0 in fp32 (_dequant_tile). Both 0 for a GEMV."""

    swap_ab: int = 0
    packed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("swap_ab", "packed"):
            v = getattr(self, name)
            if v not in (0, 1) or (v and self.block_m == 1):
                raise ValueError(f"W4A16Config.{name} must be 0 or 1 (0 for a GEMV, block_m 1), got {v}")

    def fits(self, group_size: int) -> bool:
        """Whether a K tile (a GEMV's K step) lies inside one group or holds whole groups."""
        return group_size % self.block_k == 0 or self.block_k % group_size == 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> W4A16Config:
        """The record's fields; a record without swap_ab or packed (written before they existed) has 0."""
        base = GemmConfig.from_dict(d)
        return cls(**asdict(base), swap_ab=int(d.get("swap_ab", 0)), packed=int(d.get("packed", 0)))


def supports_group(group_size: int) -> bool:
    """Whether some K tile (a power of two >= 16) fits groups of `group_size` (a multiple of 8)."""
    return group_size > 0 and (group_size % 16 == 0 or 16 % group_size == 0)


def _block_k_for(block_k: int, group_size: int) -> int:
    """block_k, halved until it fits the groups (a power of two dividing G, or G dividing it)."""
    while block_k > 16 and group_size % block_k and block_k % group_size:
        block_k //= 2
    return block_k


def gemv_steps(k: int, block_k: int, group_size: int) -> tuple[int, int]:
    """(block_k, unrolled steps) of the GEMV over K: block_k no wider than K needs, raised while the
    steps exceed MAX_GEMV_UNROLL, then halved until it fits the groups (so a group size like 48
    keeps 16-wide steps, more of them)."""
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    while triton.cdiv(k, block_k) > MAX_GEMV_UNROLL:
        block_k *= 2
    block_k = _block_k_for(block_k, group_size)
    return block_k, triton.cdiv(k, block_k)


def _prefetch_bytes(n: int, k: int, prefetch_k: int) -> int:
    """Bytes of each packed weight row (K/2) a GEMV program asks L2 for before its PDL wait: all of
    them (up to MAX_GEMV_PREFETCH) for a weight of at most GEMV_PREFETCH_ALL bytes, else prefetch_k,
    as fp8_gemm's GEMV (whose measurements chose it: whole rows of a weight past half of L2 are
    evicted before they are read)."""
    if prefetch_k == 0:
        return 0
    if n * k // 2 <= GEMV_PREFETCH_ALL:
        return min(MAX_GEMV_PREFETCH, max(128, triton.next_power_of_2(k // 2)))
    return min(prefetch_k, max(128, triton.next_power_of_2(k // 2)))


def default_gemv(n: int, k: int, group_size: int = 128) -> W4A16Config:
    """The one-token GEMV's config. Measured on an H200 (the tuner's timing, PDL, bf16) over 4-32
    rows a program, 512-2048-wide K steps and 2-8 warps: a weight of up to 16 MB packed takes 8
    rows, 2048-wide steps (1 KB of each row a step), 8 warps (qkv 8.8 µs, 4 warps 1024-wide 10.7;
    o 6.2 / 6.7); a larger one 16 rows, 1024-wide steps, 4 warps (gate_up 25.6, 8 rows 26.2,
    2048-wide 29.0; down 19.3, 8 rows 23.5). Asking L2 for a program's whole rows up front was
    slower at every shape (qkv 8.8 -> 9.1, gate_up 25.6 -> 28.2)."""
    if n * k // 2 <= 16 << 20:
        return W4A16Config(1, 8, 2048, 1, 8, 1)
    return W4A16Config(1, 16, 1024, 1, 4, 1)


def default_config(m: int, n: int, k: int, group_size: int = 128) -> W4A16Config:
    """Heuristic config per token-count bucket (H100-sized: 132 SMs). Measured on an H200 with
    the tuner's timing (CUDA graphs, weights rotated past L2), qwen3-8b's four shapes:

    - m == 1: the GEMV (default_gemv), unless the group size forces K steps too narrow to unroll.
    - m <= 16 (decode): streaming the N*K/2 weight bytes is the whole cost, and unpacking it the
      work: swapped 16 x 64 x 256 tiles (64 weight rows the dot's first operand) and split-K
      until >= 256 programs (2 per SM): qkv 22.5 -> 15.9 µs, o 14.2 -> 12.7, gate_up 58.5 ->
      47.0, down 35.7 -> 30.4 against the plain 16 x 32 tiles.
    - m <= 64: 32/64 x 64 x 128 tiles, split-K only when the tiles fill less than half of the SMs.
    - m <= 512: 64 x 128 x 64, 4 warps.
    - larger: swapped 256 x 128 x 64 tiles, 8 warps (each unpacked [128, 64] weight tile shared by
      256 tokens): at 1024 tokens qkv 160 -> 149 µs, o 98 -> 76, gate_up 563 -> 451, down 298 -> 246
      against the plain 128 x 128 x 64."""
    if m == 1 and gemv_steps(k, 1024, group_size)[1] <= MAX_GEMV_UNROLL:
        return default_gemv(n, k, group_size)
    if m <= 16:
        bn, bk = 64, _block_k_for(256, group_size)
        return W4A16Config(16, bn, bk, split_for(triton.cdiv(n, bn), k, bk, 256), 4, 4, 1)
    if m <= 64:
        bm, bn, bk = (32 if m <= 32 else 64), 64, _block_k_for(128, group_size)
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        return W4A16Config(bm, bn, bk, split_for(tiles, k, bk, _NUM_SMS_H100 // 2 + 1), 4, 4)
    bk = _block_k_for(64, group_size)
    if m <= 512:
        return W4A16Config(64, 128, bk, 1, 4, 4)
    return W4A16Config(256, 128, bk, 1, 8, 3, 1)


def sweep_configs(m: int, n: int, k: int, group_size: int = 128) -> list[W4A16Config]:
    """A small candidate list for the tuner to time at (m, n, k); default_config comes first, and
    every candidate fits `group_size`. One token: GEMVs beside the 16-row tiles; each bucket:
    plain and swapped (swap_ab) tiles, and a few with bf16x2 unpacking (packed)."""
    cands: list[W4A16Config] = [default_config(m, n, k, group_size)]
    if m == 1 and gemv_steps(k, 1024, group_size)[1] <= MAX_GEMV_UNROLL:
        for bn, bk, warps in ((8, 2048, 8), (8, 1024, 4), (16, 1024, 4), (4, 1024, 4), (32, 1024, 4)):
            cands.append(W4A16Config(1, bn, bk, 1, warps, 1))
    if m <= 16:
        for bn, bk, warps, stages, swap in (
            (32, 256, 4, 4, 0),
            (64, 256, 4, 4, 0),
            (64, 128, 4, 4, 1),
            (64, 256, 4, 4, 1),
            (128, 128, 4, 4, 1),
            (128, 128, 8, 3, 1),
        ):
            bk = _block_k_for(bk, group_size)
            tiles = triton.cdiv(n, bn)
            for target in (_NUM_SMS_H100, 2 * _NUM_SMS_H100):
                cands.append(W4A16Config(16, bn, bk, split_for(tiles, k, bk, target), warps, stages, swap))
    elif m <= 512:
        bm = 32 if m <= 32 else 64
        for bn, bk, warps, stages, swap in (
            (64, 128, 4, 4, 0),
            (128, 64, 4, 4, 0),
            (128, 64, 4, 4, 1),
            (128, 128, 8, 3, 1),
            (64, 128, 4, 4, 1),
        ):
            bk = _block_k_for(bk, group_size)
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            cands.append(W4A16Config(bm, bn, bk, 1, warps, stages, swap))
            cands.append(W4A16Config(bm, bn, bk, split_for(tiles, k, bk, _NUM_SMS_H100), warps, stages, swap))
    else:
        for bm, bn, bk, warps, stages, swap in (
            (128, 128, 64, 8, 3, 0),
            (128, 256, 64, 8, 3, 0),
            (128, 128, 64, 8, 4, 1),
            (256, 128, 64, 8, 3, 1),
            (128, 128, 128, 8, 3, 1),
            (256, 128, 64, 8, 4, 1),
            (128, 64, 64, 4, 4, 1),
        ):
            cands.append(W4A16Config(bm, bn, _block_k_for(bk, group_size), 1, warps, stages, swap))
    # bf16x2 unpacking (packed) of the first tile candidate and two swapped ones: not yet timed on a
    # GPU against the fp32 unpacking, so the tuner decides
    tiles = [c for c in dict.fromkeys(cands) if c.block_m > 1]
    cands += [replace(c, packed=1) for c in tiles[:1] + [c for c in tiles[1:] if c.swap_ab][:2]]
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
def _dequant_pairs_bf16(words, scale2, zoff2, HW: tl.constexpr):
    """int32 words [BN, W] -> four int32 [BN, W] of bf16 pairs: pair p holds the reference weight
    of column 8w + p (low half) and 8w + p + 4 (high half). On a GPU (HW), per pair: one shift, one
    lop3 making (code | 0x4300) = 128 + code in bf16 (exact), one bf16x2 FMA subtracting 128 + z
    (exact: a small integer), one bf16x2 FMA by the scale (the product rounded once, the
    reference's weight). scale2: bf16x2 (s, s); zoff2: bf16x2 (-(128 + z), -(128 + z)). Under the
    interpreter the same bits from fp32 arithmetic and an integer rounding to bf16."""
    if HW:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, t2, t3, one, nz;
            mov.b32 one, 0x3F803F80;
            mov.b32 nz, 0x80008000;
            lop3.b32 t0, $4, 0x000F000F, 0x43004300, 0xea;
            shr.u32 t1, $4, 4;
            lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xea;
            shr.u32 t2, $4, 8;
            lop3.b32 t2, t2, 0x000F000F, 0x43004300, 0xea;
            shr.u32 t3, $4, 12;
            lop3.b32 t3, t3, 0x000F000F, 0x43004300, 0xea;
            fma.rn.bf16x2 t0, t0, one, $6;
            fma.rn.bf16x2 t1, t1, one, $6;
            fma.rn.bf16x2 t2, t2, one, $6;
            fma.rn.bf16x2 t3, t3, one, $6;
            fma.rn.bf16x2 $0, t0, $5, nz;
            fma.rn.bf16x2 $1, t1, $5, nz;
            fma.rn.bf16x2 $2, t2, $5, nz;
            fma.rn.bf16x2 $3, t3, $5, nz;
            }""",
            "=r,=r,=r,=r,r,r,r",
            [words, scale2, zoff2],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
    else:
        s = (scale2 << 16).to(tl.float32, bitcast=True)  # the low halves: bf16 bits are fp32's top half
        z = (zoff2 << 16).to(tl.float32, bitcast=True)
        return (
            _emulated_pair(words, 0, s, z),
            _emulated_pair(words, 4, s, z),
            _emulated_pair(words, 8, s, z),
            _emulated_pair(words, 12, s, z),
        )


@triton.jit
def _emulated_pair(words, shift: tl.constexpr, s, z):
    """The bf16 pair of _dequant_pairs_bf16 for the codes at bits shift and shift + 16, in fp32."""
    lo = (((words >> shift) & 0xF).to(tl.float32) + 128.0 + z) * s  # exact in fp32
    hi = (((words >> (shift + 16)) & 0xF).to(tl.float32) + 128.0 + z) * s
    lo_bits = (round_bf16(lo).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    return lo_bits | (round_bf16(hi).to(tl.int32, bitcast=True) & -65536)


@triton.jit
def _bf16_pair(v):
    """bf16 values (any shape) -> int32 (v, v): both halves the value's bits."""
    b = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _dequant_words_bf16(
    words, s_ptr, z_ptr, rn, k, K, stride_sn, stride_zn,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZP: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """The words [BLOCK_N, BLOCK_K/8] of rows rn from column k unpacked by _dequant_pairs_bf16 with
    their groups' bf16 scales (and zero points): four int32 [BLOCK_N, BLOCK_K/8] of bf16 pairs."""
    if BLOCK_K <= GROUP:  # the step lies inside one group: one scale per row
        s = tl.load(s_ptr + rn * stride_sn + k // GROUP)[:, None]  # [BLOCK_N, 1]
        if HAS_ZP:
            z = tl.load(z_ptr + rn * stride_zn + k // GROUP).to(tl.float32)[:, None]
    else:  # whole groups: each row's scales repeated over their GROUP / 8 words
        offs_g = k // GROUP + tl.arange(0, BLOCK_K // GROUP)
        mask_g = (offs_g * GROUP < K)[None, :]
        s = tl.load(s_ptr + rn[:, None] * stride_sn + offs_g[None, :], mask=mask_g, other=0.0)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP // 8)), (BLOCK_N, BLOCK_K // 8))
        if HAS_ZP:
            z = tl.load(z_ptr + rn[:, None] * stride_zn + offs_g[None, :], mask=mask_g, other=0).to(tl.float32)
            z = tl.reshape(
                tl.broadcast_to(z[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP // 8)), (BLOCK_N, BLOCK_K // 8)
            )
    if HAS_ZP:  # noqa: SIM108 (constexpr branches)
        zoff2 = _bf16_pair((-128.0 - z).to(tl.bfloat16))  # exact: -(128 + z), z in 0..15
    else:
        zoff2 = tl.full((1, 1), -1022835960, tl.int32)  # 0xC308C308: the bf16 pair (-136, -136)
    return _dequant_pairs_bf16(words, _bf16_pair(s), zoff2, HW)


@triton.jit
def _halves(pair):
    """int32 bf16 pairs [..] -> bf16 [.., 2]: (low half, high half)."""
    lo = pair.to(tl.int16).to(tl.bfloat16, bitcast=True)  # the narrowing keeps the low 16 bits
    hi = (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _bf16_tile(p0, p1, p2, p3, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_dequant_pairs_bf16's pairs [BLOCK_N, BLOCK_K/8] -> the bf16 weight tile [BLOCK_N, BLOCK_K] in
    column order: [n, w, h, i, o] holds pair 2i + o's half h, column 8w + 4h + 2i + o."""
    t = tl.join(tl.join(_halves(p0), _halves(p2)), tl.join(_halves(p1), _halves(p3)))
    return tl.reshape(t, (BLOCK_N, BLOCK_K))


@triton.jit
def _pair_fma(acc, pair, x_ptr, cols, K, EVEN_K: tl.constexpr):
    """acc [BN, W] + the products of the bf16 pair [BN, W] (columns `cols`, low halves, and cols + 4,
    high halves) with x there, in fp32 (exact products of two bf16)."""
    if EVEN_K:
        x_lo = tl.load(x_ptr + cols).to(tl.float32)
        x_hi = tl.load(x_ptr + cols + 4).to(tl.float32)
    else:
        x_lo = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        x_hi = tl.load(x_ptr + cols + 4, mask=cols + 4 < K, other=0.0).to(tl.float32)
    w_lo = (pair << 16).to(tl.float32, bitcast=True)  # a bf16's bits are its fp32's top half
    w_hi = (pair & -65536).to(tl.float32, bitcast=True)
    return acc + w_lo * x_lo[None, :] + w_hi * x_hi[None, :]


@triton.jit
def _group_scales(
    s_ptr,
    z_ptr,
    rn,
    k,
    K,
    stride_sn,
    stride_zn,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ZP: tl.constexpr,
):
    """Rows rn's scales (fp32) and code offsets (2^23 + zero point, or 2^23 + 8: symmetric) for
    columns k.. k + BLOCK_K, as _dequant_tile takes them: [BLOCK_N, 1] when the tile lies inside one
    group, else each row's BLOCK_K / GROUP values repeated over their columns [BLOCK_N, BLOCK_K]."""
    offset = 8388616.0  # 2^23 + 8: symmetric
    if BLOCK_K <= GROUP:  # the tile lies inside one group: one scale per row
        scale = tl.load(s_ptr + rn * stride_sn + k // GROUP).to(tl.float32)[:, None]  # [BLOCK_N, 1]
        if HAS_ZP:
            offset = tl.load(z_ptr + rn * stride_zn + k // GROUP).to(tl.float32)[:, None] + 8388608.0
    else:  # whole groups: each row's BLOCK_K / GROUP scales, repeated over their columns
        offs_g = k // GROUP + tl.arange(0, BLOCK_K // GROUP)
        mask_g = (offs_g * GROUP < K)[None, :]
        s = tl.load(s_ptr + rn[:, None] * stride_sn + offs_g[None, :], mask=mask_g, other=0.0).to(tl.float32)
        scale = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
        if HAS_ZP:
            z = tl.load(z_ptr + rn[:, None] * stride_zn + offs_g[None, :], mask=mask_g, other=0).to(tl.float32)
            z = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
            offset = z + 8388608.0
    return scale, offset


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
    SWAP: tl.constexpr = False,  # the transposed product w · xᵀ (W4A16Config.swap_ab)
    FAST: tl.constexpr = False,  # bf16 on a GPU: _dequant_pairs_bf16's packed unpacking
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
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m, other=0.0)
            words = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=mask_m & ((k + offs_k)[None, :] < K), other=0.0)
            words = tl.load(w_ptrs, mask=((k + offs_kw * 8) < K)[None, :], other=0)
        if FAST:  # bf16 on a GPU: _dequant_pairs_bf16's pairs, laid out as the tile
            p0, p1, p2, p3 = _dequant_words_bf16(
                words, s_ptr, z_ptr, rn, k, K, stride_sn, stride_zn, GROUP, BLOCK_N, BLOCK_K, HAS_ZP, HW
            )
            w = _bf16_tile(p0, p1, p2, p3, BLOCK_N, BLOCK_K)
            if not HW:
                w = w.to(tl.float32)  # exact: the interpreter's dots below are in fp32
        else:
            scale, offset = _group_scales(s_ptr, z_ptr, rn, k, K, stride_sn, stride_zn, GROUP, BLOCK_N, BLOCK_K, HAS_ZP)
            w = _dequant_tile(words, scale, offset, BLOCK_K, x_ptr.dtype.element_ty, HW)  # [BLOCK_N, BLOCK_K]
        if SWAP:  # yᵀ tile = w · xᵀ: the unpacked weight is the dot's first operand, kept in registers
            if HW:  # noqa: SIM108 (two launch paths read better as branches in a kernel)
                acc = tl.dot(w, tl.trans(x), acc)
            else:
                acc = tl.dot(w, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        elif HW:
            acc = tl.dot(x, tl.trans(w), acc)  # fp32 accumulation
        else:  # the interpreter's dot of a loaded bf16 tile with a cast one is wrong: in fp32, the same products
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8

    if SWAP:  # acc [BLOCK_N, BLOCK_M] holds the tile transposed
        rows, cols = offs_m[None, :], offs_n[:, None]
    else:
        rows, cols = offs_m[:, None], offs_n[None, :]
    mask_c = (rows < M) & (cols < N)
    if SPLIT_K > 1:  # fp32 partial of K range pid_k; _splitk_sum_kernel adds them
        tl.store(part_ptr + pid_k * M * N + rows * N + cols, acc, mask=mask_c)
    else:
        y = round_to(acc, c_ptr.dtype.element_ty, HW)  # exact in the output dtype
        tl.store(c_ptr + rows * stride_cm + cols, y.to(c_ptr.dtype.element_ty), mask=mask_c)


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


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [1, K] bf16 / fp16
    w_ptr,  # [N, K/8] int32
    s_ptr,  # [N, K/GROUP]
    z_ptr,  # [N, K/GROUP] uint8 zero-point codes (HAS_ZP only)
    c_ptr,  # [1, N] out dtype
    N,
    K,
    stride_wn,
    stride_sn,
    stride_zn,
    GROUP: tl.constexpr,  # columns per scale: a multiple of BLOCK_K, or BLOCK_K a multiple of it
    NUM_K: tl.constexpr,  # K steps, unrolled
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    HAS_ZP: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,  # with PDL: bytes of each weight row asked of L2 before the wait
    FAST: tl.constexpr = False,  # bf16 on a GPU: _dequant_pairs_bf16's packed unpacking
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.where(offs_n < N, offs_n, 0)  # rows past N read row 0 (never stored)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // 8)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + offs_kw[None, :]  # [BLOCK_N, BLOCK_K/8]
    if PDL and PREFETCH_K > 0:  # the weights do not depend on the previous kernel: start reading them
        lines = tl.arange(0, PREFETCH_K // 128) * 32  # 128-byte L2 lines, in words
        prefetch_l2(w_ptr + rn[:, None].to(tl.int64) * stride_wn + tl.minimum(lines, K // 8 - 1)[None, :])
    wait_for_inputs(PDL)
    if FAST:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for step in tl.static_range(NUM_K):
        k = step * BLOCK_K
        if EVEN_K:
            words = tl.load(w_ptrs + k // 8)
        else:
            words = tl.load(w_ptrs + k // 8, mask=((k + offs_kw * 8) < K)[None, :], other=0)
        if FAST:  # bf16 on a GPU: the pairs of _dequant_pairs_bf16, x read by column of each word
            p0, p1, p2, p3 = _dequant_words_bf16(
                words, s_ptr, z_ptr, rn, k, K, stride_sn, stride_zn, GROUP, BLOCK_N, BLOCK_K, HAS_ZP, HW
            )
            cols = k + offs_kw * 8  # column 0 of each word
            acc = _pair_fma(acc, p0, x_ptr, cols, K, EVEN_K)
            acc = _pair_fma(acc, p1, x_ptr, cols + 1, K, EVEN_K)
            acc = _pair_fma(acc, p2, x_ptr, cols + 2, K, EVEN_K)
            acc = _pair_fma(acc, p3, x_ptr, cols + 3, K, EVEN_K)
        else:
            if EVEN_K:
                x = tl.load(x_ptr + k + offs_k).to(tl.float32)
            else:
                x = tl.load(x_ptr + k + offs_k, mask=k + offs_k < K, other=0.0).to(tl.float32)
            scale, offset = _group_scales(s_ptr, z_ptr, rn, k, K, stride_sn, stride_zn, GROUP, BLOCK_N, BLOCK_K, HAS_ZP)
            w = _dequant_tile(words, scale, offset, BLOCK_K, x_ptr.dtype.element_ty, HW)  # the reference's weight
            acc += w.to(tl.float32) * x[None, :]  # exact products (8 or 11 by 8 or 11 bits), fp32 sums
    y = round_to(tl.sum(acc, axis=1), c_ptr.dtype.element_ty, HW)
    tl.store(c_ptr + offs_n, y.to(c_ptr.dtype.element_ty), mask=offs_n < N)


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
    prefetch_k: int = 0,
    fast: bool | None = None,
) -> torch.Tensor:
    """W4A16 linear: x [M,K] times the int4 weight w [N,K/8] with scales ws [N,K/group_size] (and
    zero-point codes wz, uint8 [N,K/group_size], when given: asymmetric int4), transposed -> [M,N]
    in out_dtype (default x's dtype; float32 gives the fp32 sum unrounded).

    x: bf16/fp16, rows contiguous; ws: any float dtype, cast to x's (the reference rounds the
    weight in x's dtype, with the scale in x's dtype). config: tile sizes, split-K and launch
    parameters; default_config(M, N, K, group_size) when None. pdl: programmatic dependent launch
    (kernels/pdl.py); with it a GEMV program first asks L2 for `prefetch_k` bytes of each of its
    packed rows (0: none; a weight of at most GEMV_PREFETCH_ALL bytes: its whole rows). fast: bf16
    unpacking by _dequant_pairs_bf16 (bf16x2 instructions on a GPU, emulated under the
    interpreter) rather than in fp32; the same weights to the bit either way; None: on a GPU only.
    Raises ValueError on a dtype, shape, stride or device mismatch, or a config whose K tile
    neither lies inside a group nor holds whole groups.
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
    if cfg.block_m == 1 and m != 1:  # a GEMV config stands for the tiled default above one token
        cfg = default_config(m, n, k, group_size)
    if not cfg.fits(group_size):
        raise ValueError(f"block_k {cfg.block_k} neither divides nor is a multiple of group_size {group_size}")
    if prefetch_k < 0 or prefetch_k % 128 or prefetch_k & (prefetch_k - 1):
        raise ValueError(f"prefetch_k must be 0 or a power of two multiple of 128 bytes, got {prefetch_k}")
    if ws.dtype != x.dtype:
        ws = ws.to(x.dtype)
    hw = use_hw_casts(x)
    packed = x.dtype == torch.bfloat16 and (hw and (cfg.block_m == 1 or cfg.packed) if fast is None else fast)
    if cfg.block_m == 1:
        block_k, steps = gemv_steps(k, cfg.block_k, group_size)
        _w4a16_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, w, ws, ws if wz is None else wz, out, n, k, w.stride(0), ws.stride(0),
            0 if wz is None else wz.stride(0),
            GROUP=group_size, NUM_K=steps, BLOCK_N=cfg.block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
            HAS_ZP=wz is not None, HW=use_hw_casts(x), num_warps=cfg.num_warps,
            FAST=packed,
            PREFETCH_K=_prefetch_bytes(n, k, prefetch_k) if pdl else 0,
            **launch_options(pdl),
        )  # fmt: skip
        return out
    k_tiles = triton.cdiv(k, cfg.block_k)
    tiles_per_split = triton.cdiv(k_tiles, min(cfg.split_k, k_tiles))
    split = triton.cdiv(k_tiles, tiles_per_split)  # no empty split
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
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
        SWAP=bool(cfg.swap_ab),
        FAST=packed,
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
