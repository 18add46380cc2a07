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
"""

from __future__ import annotations

import torch

BITS = 4
Q_MIN, Q_MAX = -8, 7
PER_INT32 = 32 // BITS
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


def dequantize(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """q * scale [rows, cols] in the scale's dtype (compressed-tensors' dequantization)."""
    q = unpack_int4(packed)
    rows, cols = q.shape
    groups = q.reshape(rows, cols // group_size, group_size).to(scale.dtype)
    return (groups * scale[..., None]).reshape(rows, cols)
