"""StoredFormat: how a pre-quantized checkpoint stores its quantized linears, whichever tool wrote it.

The readers of config.json's quantization_config (qcompile.source.compressed_tensors,
qcompile.source.qwen_fp8) each return one; qcompile.source.stored finds and checks the tensors it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from qcompile.quant import QuantScheme, get_scheme

SCHEMES = ("ptpc-fp8", "tensor-fp8", "block-fp8", "w4a16")  # the schemes a stored checkpoint can be in
WHAT = MappingProxyType(
    {
        "ptpc-fp8": "FP8 weights, one scale per output channel; activations FP8 per token (llm-compressor FP8_DYNAMIC)",
        "tensor-fp8": "FP8 weights, one scale per tensor; activations FP8 per tensor, dynamic",
        "block-fp8": "FP8 weights in 128x128 blocks; activations FP8 in groups of 128 (llm-compressor FP8_BLOCK)",
        "w4a16": "int4 weights, symmetric, one scale per 128 input columns; activations unquantized "
        "(llm-compressor W4A16)",
    }
)


@dataclass(frozen=True)
class StoredFormat:
    """How a pre-quantized checkpoint stores its quantized linears, and the scheme that reads them as they are.

    Tensor names are the module's name plus a key: `{module}.{weight_key}`, `{module}.{scale_key}`
    and each of `aux_keys` (compressed-tensors' `weight_shape` of packed int4: the logical shape).
    `ignore` is the config's own list of modules left unquantized (names or `re:` patterns).
    """

    method: str  # config.json's quant_method
    format: str  # its storage format: float-quantized | pack-quantized
    scheme: str  # the qcompile scheme whose artifact tensors these are, byte for byte
    ignore: tuple[str, ...] = ()
    weight_key: str = "weight"
    scale_key: str = "weight_scale"
    aux_keys: tuple[str, ...] = ()
    actorder: str | None = None  # GPTQ act-order: 'weight' (stored in order) or 'group' (weight_g_idx)

    @property
    def quant(self) -> QuantScheme:
        return get_scheme(self.scheme)

    def weight_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        """The stored weight's shape for a linear of logical [rows, cols] (packed int4: 8 columns an int32)."""
        return self.quant.stored_shape(shape)

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        """The stored scale's shape for a linear of logical [rows, cols]: compressed-tensors keeps a
        per-tensor scale as one value [1] (the artifact repeats it on every row)."""
        if self.quant.per_tensor:
            return (1,)
        scale = self.quant.scale_shape(shape)
        assert scale is not None
        return scale

    def describe(self) -> str:
        """One line for people: the method, format and what it holds."""
        order = f", act-order {self.actorder!r}" if self.actorder else ""
        return f"{self.method} {self.format}{order}: {WHAT[self.scheme]}"

    def to_dict(self) -> dict[str, Any]:
        """What the manifest records of the source's quantization (`source.quantization`)."""
        return {"method": self.method, "format": self.format, "scheme": self.scheme} | (
            {"actorder": self.actorder} if self.actorder else {}
        )
