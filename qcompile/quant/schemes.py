"""The quantization schemes a recipe can name, as typed values in a read-only registry."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import torch
from qruntime.target import to_e4m3fnuz

from qcompile.quant import fp8, int4


@dataclass(frozen=True)
class PerChannel:
    """One scale per output row (the weight half of PTPC)."""


@dataclass(frozen=True)
class PerTensor:
    """One scale per source tensor (compressed-tensors' `strategy: tensor`).

    Stored as [rows, 1] like per-channel scales, each row holding its source tensor's one value,
    so the per-channel GEMM runs it unchanged: a fused qkv_proj scale holds three different values
    (q rows, k rows, v rows), an MoE w13 scale two per expert (gate rows, up rows).
    """


@dataclass(frozen=True)
class PerBlock:
    """One scale per block_n x block_k tile."""

    block_n: int = 128
    block_k: int = 128


@dataclass(frozen=True)
class PerGroupInt4:
    """int4 weights, one scale per `group_size` consecutive input columns of a row, packed eight to an
    int32 along the row (compressed-tensors' `pack-quantized`; qcompile.quant.int4). Symmetric, or with
    `zero_point`: one 4-bit zero point per group beside each scale (asymmetric int4, as AutoAWQ and
    compressed-tensors' `symmetric: false` store it), read from pre-quantized checkpoints only."""

    group_size: int = 128
    zero_point: bool = False


@dataclass(frozen=True)
class QuantScheme:
    """How a linear layer's weight is stored and which graph op consumes it.

    `weights` is None for an unquantized scheme. `activation_group` is the runtime's dynamic
    activation quantization: 0 = one scale per token, n = one scale per n consecutive channels,
    -1 = one scale for the whole [T, K] activation of a step (per-tensor), None = activations stay
    in the model dtype (weight-only schemes such as w4a16).
    """

    name: str
    weights: PerChannel | PerTensor | PerBlock | PerGroupInt4 | None
    activation_group: int | None
    linear_op: str
    llmcompressor_scheme: str | None  # the preset it is byte-compatible with, when any
    # the FP8 format its weights are stored in (the compile target's, qruntime.target): e4m3fn, or
    # e4m3fnuz for amd-gfx942, whose codes are e4m3fn's with the scales doubled (target.to_e4m3fnuz)
    fp8: str = "float8_e4m3fn"

    def __post_init__(self) -> None:
        if self.fp8 not in ("float8_e4m3fn", "float8_e4m3fnuz"):
            raise ValueError(f"scheme {self.name!r}: unknown FP8 format {self.fp8!r}")

    @property
    def quantized(self) -> bool:
        return self.weights is not None

    @property
    def quantizes_activations(self) -> bool:
        """Whether the linear op reads activations quantized at run time (a DynamicQuant before it)."""
        return self.quantized and self.activation_group is not None

    @property
    def int4(self) -> PerGroupInt4 | None:
        """The int4 group layout of a w4a16-style scheme, else None."""
        return self.weights if isinstance(self.weights, PerGroupInt4) else None

    @property
    def zero_point(self) -> bool:
        """Whether each int4 group has its own zero point (`{name}.weight_zero_point`, uint8 codes)."""
        return self.int4 is not None and self.int4.zero_point

    @property
    def weight_key(self) -> str:
        """The last component of the weight's tensor name: `weight`, or `weight_packed` for packed
        int4 (as compressed-tensors names it); the scale is `weight_scale` either way."""
        return "weight_packed" if self.int4 else "weight"

    @property
    def per_tensor(self) -> bool:
        """Whether a chunk's scale depends on its whole source tensor: the writer then reads each
        source once for its amax (`fp8.tensor_amax`) before quantizing its chunks with it."""
        return isinstance(self.weights, PerTensor)

    @property
    def row_align(self) -> int:
        """Row chunks must start at multiples of this for chunked quantization to be exact."""
        return self.weights.block_n if isinstance(self.weights, PerBlock) else 1

    def weight_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if self.int4:
            return torch.int32
        return getattr(torch, self.fp8) if self.quantized else model_dtype

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored weight's shape for a weight of logical `shape` (rows and columns of the source,
        experts first when stacked): packed int4 holds 8 columns per int32, the others are as is."""
        if self.int4:
            return (*shape[:-1], shape[-1] // int4.PER_INT32)
        return tuple(shape)

    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """`stored_shape`'s inverse: the source rows and columns a stored weight of shape `stored` holds."""
        if self.int4:
            return (*stored[:-1], stored[-1] * int4.PER_INT32)
        return tuple(stored)

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int] | None:
        """Shape of the scale of a [rows, cols] weight (logical columns), or None when unquantized."""
        rows, cols = shape
        if isinstance(self.weights, PerChannel | PerTensor):
            return (rows, 1)
        if isinstance(self.weights, PerGroupInt4):
            return (rows, cols // self.weights.group_size)
        if isinstance(self.weights, PerBlock):
            return (math.ceil(rows / self.weights.block_n), math.ceil(cols / self.weights.block_k))
        return None

    def quantize(self, w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize a [rows, cols] chunk of one source tensor whose first row is a multiple of
        `row_align`; returns (fp8 [rows, cols], scale in the artifact's layout), or for int4
        (packed int32 [rows, cols / 8], scale [rows, cols / group_size]).

        Per-tensor schemes need `amax`, the `fp8.tensor_amax` of the whole source tensor the chunk
        belongs to; without it the chunk is taken to be the whole tensor. Their scale comes back as
        [rows, 1], the one value repeated on every row.
        """
        if isinstance(self.weights, PerChannel | PerTensor | PerBlock):
            return self.in_format(*self._quantize_fp8(w, amax))
        if isinstance(self.weights, PerGroupInt4) and not self.weights.zero_point:
            return int4.quantize_int4(w, self.weights.group_size)
        if isinstance(self.weights, PerGroupInt4):
            raise TypeError(f"scheme {self.name!r} is read from pre-quantized checkpoints only, never quantized here")
        raise TypeError(f"scheme {self.name!r} does not quantize")

    def _quantize_fp8(self, w: torch.Tensor, amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """llm-compressor's e4m3fn codes and scales (qcompile.quant.fp8) of a chunk."""
        if isinstance(self.weights, PerChannel):
            return fp8.quantize_per_channel(w)
        if isinstance(self.weights, PerTensor):
            q, scale = fp8.quantize_per_tensor(w, amax)
            return q, scale.expand(w.shape[0], 1)
        assert isinstance(self.weights, PerBlock)
        return fp8.quantize_per_block(w, (self.weights.block_n, self.weights.block_k))

    def in_format(self, codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """e4m3fn codes and their scale in this scheme's FP8 format (as they are for e4m3fn)."""
        if self.fp8 == "float8_e4m3fn":
            return codes, scale
        return to_e4m3fnuz(codes, scale)


SCHEMES = MappingProxyType(
    {
        "ptpc-fp8": QuantScheme("ptpc-fp8", PerChannel(), 0, "PTPCLinear", "FP8_DYNAMIC"),
        # vLLM's load-time `--quantization fp8` (dynamic per-tensor activations), but with one weight
        # scale per source tensor where vLLM gives a fused qkv / gate_up one (the largest of its
        # parts'); no compressed-tensors preset is this (its FP8 has static activation scales)
        "tensor-fp8": QuantScheme("tensor-fp8", PerTensor(), -1, "PTPCLinear", None),
        "block-fp8": QuantScheme("block-fp8", PerBlock(128, 128), 128, "BlockFP8Linear", "FP8_BLOCK"),
        # int4 weights in groups of 128 along K, activations in the model dtype (weight-only)
        "w4a16": QuantScheme("w4a16", PerGroupInt4(128), None, "W4A16Linear", "W4A16"),
        # the same with a zero point per group (asymmetric int4: AutoAWQ GEMM, compressed-tensors
        # `symmetric: false`), transcoded from pre-quantized checkpoints only
        "w4a16-zp": QuantScheme("w4a16-zp", PerGroupInt4(128, zero_point=True), None, "W4A16Linear", None),
        "none": QuantScheme("none", None, 0, "Gemm", None),
    }
)


def get_scheme(name: str) -> QuantScheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise KeyError(f"unknown quantization scheme {name!r}; known: {', '.join(SCHEMES)}") from None
