"""Symmetric int4 weights in groups along K, packed eight to an int32: the arithmetic and layout of
llm-compressor's W4A16 preset (compressed-tensors `pack-quantized`), byte for byte.

For each group of `group_size` consecutive input columns of a row, in the weight's dtype D (bf16
for Qwen3), as compressed-tensors computes it:
  scale = max(|min(group, 0)|, max(group, 0)) / 7.5      (D arithmetic: 7.5 = (7 - (-8)) / 2 in D)
  scale = eps(D) where it is 0                            (an all-zero group)
  q     = clamp(round_half_even(D(w / scale)), -8, 7)      (the quotient rounded to D first)
Packing: q + 8 as a 4-bit code, eight codes to an int32, column j of a row in bits 4 (j mod 8) of
int32 j // 8 (the first column in the low nibble). `unpack_int4` inverts it; `dequantize` gives
q * scale in D, what a W4A16 linear multiplies by.

Asymmetric int4 (scheme `w4a16-zp`, read from pre-quantized checkpoints only) adds one zero point
per group, kept as its 4-bit code z in [0, 15] (uint8, the weight codes' offset: compressed-tensors'
signed zero point + 8, AutoAWQ's as stored): the weight is (code - z) * scale, rounded once to D.
Symmetric int4 is the case z = 8. `pack_rows_int4` / `unpack_rows_int4` are compressed-tensors' packing
of zero points along the rows (eight rows of one group to an int32).
"""

from __future__ import annotations

import torch

BITS = 4
Q_MIN, Q_MAX = -8, 7
PER_INT32 = 32 // BITS
CODE_MAX = (1 << BITS) - 1
SYMMETRIC_ZERO = -Q_MIN  # the code of 0: symmetric int4's zero point
HALF_RANGE = (Q_MAX - Q_MIN) / 2  # 7.5, exact in bf16 / fp16 / fp32


def check_groups(shape: tuple[int, int], group_size: int, name: str = "weight") -> None:
    """ValueError naming `name` unless its columns split into whole groups of whole int32 words."""
    rows, cols = shape
    if group_size <= 0 or group_size % PER_INT32:
        raise ValueError(f"group_size must be a positive multiple of {PER_INT32}, got {group_size}")
    if cols % group_size:
        raise ValueError(
            f"{name} {list(shape)}: its {cols} input columns are not a multiple of the group size "
            f"{group_size} (int4 groups must not straddle the end of a row); leave it unquantized "
            f"(quantization.ignore) or use another scheme"
        )


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] float weight -> (packed int32 [rows, cols / 8], scale [rows, cols / group_size]
    in w's dtype), as llm-compressor's W4A16 writes them (see the module docstring)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor, got {w.dtype} {tuple(w.shape)}")
    check_groups(tuple(w.shape), group_size)
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group_size, group_size)
    low = torch.minimum(groups.amin(-1), torch.zeros((), dtype=w.dtype))
    high = torch.maximum(groups.amax(-1), torch.zeros((), dtype=w.dtype))
    scale = torch.maximum(low.abs(), high.abs()) / torch.tensor(HALF_RANGE, dtype=w.dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype), scale)
    q = torch.round(groups / scale[..., None]).clamp_(Q_MIN, Q_MAX).to(torch.int8)
    return pack_int4(q.reshape(rows, cols)), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7], [rows, cols] with cols a multiple of 8 -> int32 [rows, cols / 8]."""
    rows, cols = q.shape
    if cols % PER_INT32:
        raise ValueError(f"{cols} columns do not fill whole int32 words of {PER_INT32} int4 codes")
    codes = (q.to(torch.int64) - Q_MIN).reshape(rows, cols // PER_INT32, PER_INT32)
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64)
    words = (codes << shifts).sum(-1)  # < 2^32: fits int64, then wraps into int32 two's complement
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, words] -> int8 codes [rows, words * 8] in [-8, 7] (pack_int4's inverse)."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)
    codes = (packed[..., None] >> shifts) & 0xF  # an arithmetic shift: the mask drops the sign bits
    return (codes.reshape(*packed.shape[:-1], -1) + Q_MIN).to(torch.int8)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, group_size: int, zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    """q * scale [rows, cols] in the scale's dtype (compressed-tensors' dequantization), or with
    zero-point codes [rows, cols / group_size] (uint8 in [0, 15]) (code - zero_point) * scale."""
    q = unpack_int4(packed)
    rows, cols = q.shape
    groups = q.reshape(rows, cols // group_size, group_size).to(torch.int16)
    if zero_point is not None:
        groups = groups - (zero_point.to(torch.int16) - SYMMETRIC_ZERO)[..., None]  # exact: |q - z| <= 15
    return (groups.to(scale.dtype) * scale[..., None]).reshape(rows, cols)


def pack_rows_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [rows, cols] in [0, 15] -> int32 [ceil(rows / 8), cols]: row r of a column in bits
    4 (r mod 8) of word r // 8, the last word's missing rows 0 (compressed-tensors' zero-point packing)."""
    rows, cols = codes.shape
    words = -(-rows // PER_INT32)
    padded = torch.zeros(words * PER_INT32, cols, dtype=torch.int64)
    padded[:rows] = codes.to(torch.int64)
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64)[None, :, None]
    packed = (padded.reshape(words, PER_INT32, cols) << shifts).sum(1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def unpack_rows_int4(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """`pack_rows_int4`'s inverse: int32 [ceil(rows / 8), cols] -> uint8 codes [rows, cols]."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)
    codes = (packed[:, None, :] >> shifts[None, :, None]) & CODE_MAX  # [words, 8, cols]
    return codes.reshape(-1, packed.shape[1])[:rows].to(torch.uint8)
