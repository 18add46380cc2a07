"""FP8 E4M3 weight quantization, bit-identical to llm-compressor's FP8 schemes.

llm-compressor (compressed-tensors) does this math in the weight's own dtype: the scale is
amax(|w|) / 448 rounded to that dtype (a zero amax becomes the dtype's machine epsilon), the weight
is divided by the scale in that dtype, clamped to ±448 and cast to float8_e4m3fn (round to nearest
even). The functions below keep each step in the same dtype and order, so the bytes match. Per-tensor
weights (compressed-tensors' `strategy: tensor`) follow the same steps with one amax over the whole
tensor; compressed-tensors stores that scale as a [1] tensor in the weight dtype.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0


_INT_VIEW = MappingProxyType({2: (torch.int16, 0x7FFF), 4: (torch.int32, 0x7FFFFFFF)})


def amax_abs(w: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """amax(|w|) over `dim`, exactly; NaN and Inf come through as NaN and Inf.

    For IEEE floats the bit pattern with the sign cleared orders like the magnitude (NaN above
    Inf), so an integer max over the masked bits is the float amax — about 2x faster on CPU than
    abs().amax() for bf16, which matters when streaming hundreds of GB.
    """
    if w.element_size() not in _INT_VIEW:
        return w.abs().amax(dim=dim, keepdim=True)
    itype, mask = _INT_VIEW[w.element_size()]
    return (w.view(itype) & mask).amax(dim=dim, keepdim=True).view(w.dtype)


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
    scale = _scale_from_amax(amax_abs(w, dim=1))
    return _cast(w, scale), scale


def tensor_amax(w: torch.Tensor) -> torch.Tensor:
    """amax(|w|) over all of w, shape [1] in w's dtype (NaN and Inf come through); the max of the
    amaxes of a tensor's row chunks is the amax of the whole, exactly."""
    return amax_abs(w, tuple(range(w.dim()))).reshape(1)


def quantize_per_tensor(w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for a whole tensor: w [R, C] -> (fp8 [R, C], scale [1] in w.dtype).

    `w` may be a row chunk of a larger tensor when `amax` is that whole tensor's `tensor_amax`:
    chunks quantized with it give exactly the bytes of quantizing the whole tensor at once.
    """
    scale = _scale_from_amax(tensor_amax(w) if amax is None else amax.reshape(1).to(w.dtype))
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
    amax = amax_abs(tiles, dim=(1, 3)).reshape(tiles.shape[0], tiles.shape[2])  # [R/bn, C/bk]
    scale = _scale_from_amax(amax)
    full = scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:rows, :cols]
    return _cast(w, full), scale
