"""FP8 E4M3 weight quantization, bit-identical to llm-compressor's FP8 schemes.

llm-compressor (compressed-tensors) does this math in the weight's own dtype: the scale is
amax(|w|) / 448 rounded to that dtype (a zero amax becomes the dtype's machine epsilon), the weight
is divided by the scale in that dtype, clamped to ±448 and cast to float8_e4m3fn (round to nearest
even). The functions below keep each step in the same dtype and order, so the bytes match.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax (in the weight dtype) -> scale in the same dtype, zeros replaced by epsilon."""
    scale = amax / torch.tensor(FP8_MAX, dtype=amax.dtype)
    eps = torch.tensor(torch.finfo(amax.dtype).eps, dtype=amax.dtype)
    return torch.where(scale == 0, eps, scale)


def _cast(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scaled = w / scale
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PTPC weights: one scale per output row. w [R, C] -> (fp8 [R, C], scale [R, 1] in w.dtype)."""
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = _scale_from_amax(amax)
    return _cast(w, scale), scale


def quantize_per_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scales: w [R, C] -> (fp8 [R, C], scale [ceil(R/bn), ceil(C/bk)] in w.dtype).

    Edge blocks that do not fill a whole bn x bk tile take their amax over the rows and columns
    they have (the tile is padded with zeros, which do not change an amax of absolute values).
    """
    bn, bk = block
    rows, cols = w.shape
    pr, pc = -rows % bn, -cols % bk
    padded = torch.nn.functional.pad(w, (0, pc, 0, pr)) if pr or pc else w
    tiles = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    amax = tiles.abs().amax(dim=(1, 3))  # [R/bn, C/bk]
    scale = _scale_from_amax(amax)
    full = scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:rows, :cols]
    return _cast(w, full), scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight the fp8 bytes stand for, in the scale's dtype."""
    return q.to(scale.dtype) * scale
