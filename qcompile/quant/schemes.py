"""The quantization schemes a recipe can name, as typed values in a read-only registry."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import torch

from qcompile.quant import fp8


@dataclass(frozen=True)
class PerChannel:
    """One scale per output row (the weight half of PTPC)."""


@dataclass(frozen=True)
class PerBlock:
    """One scale per block_n x block_k tile."""

    block_n: int = 128
    block_k: int = 128


@dataclass(frozen=True)
class QuantScheme:
    """How a linear layer's weight is stored and which graph op consumes it.

    `weights` is None for an unquantized scheme. `activation_group` is the runtime's dynamic
    activation quantization: 0 = one scale per token, n = one scale per n consecutive channels.
    """

    name: str
    weights: PerChannel | PerBlock | None
    activation_group: int
    linear_op: str
    llmcompressor_scheme: str | None  # the preset it is byte-compatible with, when any

    @property
    def quantized(self) -> bool:
        return self.weights is not None

    @property
    def row_align(self) -> int:
        """Row chunks must start at multiples of this for chunked quantization to be exact."""
        return self.weights.block_n if isinstance(self.weights, PerBlock) else 1

    def weight_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return fp8.FP8_DTYPE if self.quantized else model_dtype

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int] | None:
        """Shape of the scale of a [rows, cols] weight, or None when unquantized."""
        rows, cols = shape
        if isinstance(self.weights, PerChannel):
            return (rows, 1)
        if isinstance(self.weights, PerBlock):
            return (math.ceil(rows / self.weights.block_n), math.ceil(cols / self.weights.block_k))
        return None

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize a [rows, cols] chunk whose first row is a multiple of `row_align`."""
        if isinstance(self.weights, PerChannel):
            return fp8.quantize_per_channel(w)
        if isinstance(self.weights, PerBlock):
            return fp8.quantize_per_block(w, (self.weights.block_n, self.weights.block_k))
        raise TypeError(f"scheme {self.name!r} does not quantize")


SCHEMES = MappingProxyType(
    {
        "ptpc-fp8": QuantScheme("ptpc-fp8", PerChannel(), 0, "PTPCLinear", "FP8_DYNAMIC"),
        "block-fp8": QuantScheme("block-fp8", PerBlock(128, 128), 128, "BlockFP8Linear", "FP8_BLOCK"),
        "none": QuantScheme("none", None, 0, "Gemm", None),
    }
)


def get_scheme(name: str) -> QuantScheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise KeyError(f"unknown quantization scheme {name!r}; known: {', '.join(SCHEMES)}") from None
