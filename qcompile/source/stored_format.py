"""StoredFormat: how a pre-quantized checkpoint stores its quantized linears, whichever tool wrote it.

The readers of config.json's quantization_config (qcompile.source.compressed_tensors,
qcompile.source.qwen_fp8) each return one; qcompile.source.stored finds and checks the tensors it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from qcompile.quant import QuantScheme, get_scheme

SCHEMES = ("ptpc-fp8", "tensor-fp8", "block-fp8", "w4a16", "w4a16-zp")  # the schemes a stored checkpoint can be in
WHAT = MappingProxyType(
    {
        "ptpc-fp8": "FP8 weights, one scale per output channel; activations FP8 per token (llm-compressor FP8_DYNAMIC)",
        "tensor-fp8": "FP8 weights, one scale per tensor; activations FP8 per tensor, dynamic",
        "block-fp8": "FP8 weights in 128x128 blocks; activations FP8 in groups of 128 (llm-compressor FP8_BLOCK)",
        "w4a16": "int4 weights, symmetric, one scale per 128 input columns; activations unquantized "
        "(llm-compressor W4A16)",
        "w4a16-zp": "int4 weights, asymmetric (a zero point and a scale per 128 input columns); activations "
        "unquantized (AutoAWQ GEMM, compressed-tensors W4A16 with symmetric: false)",
    }
)
ROWS, AWQ_GEMM = "rows", "awq-gemm"  # how a packed int4 weight lies: [rows, cols / 8], or AutoAWQ's (see awq.py)


@dataclass(frozen=True)
class StoredFormat:
    """How a pre-quantized checkpoint stores its quantized linears, and the scheme that reads them as they are.

    Tensor names are the module's name plus a key: `{module}.{weight_key}`, `{module}.{scale_key}`,
    `{module}.{zero_point_key}` (asymmetric int4) and each of `aux_keys` (compressed-tensors'
    `weight_shape` of packed int4: the logical shape). `ignore` is the config's own list of modules
    left unquantized (names or `re:` patterns). `layout` says how packed int4 lies: ROWS, the
    artifact's own (zero points, if any, packed along the rows as compressed-tensors does), or
    AWQ_GEMM, AutoAWQ's transposed and interleaved one (qcompile.source.awq).
    """

    method: str  # config.json's quant_method
    format: str  # its storage format: float-quantized | pack-quantized
    scheme: str  # the qcompile scheme whose artifact tensors these are, byte for byte
    ignore: tuple[str, ...] = ()
    weight_key: str = "weight"
    scale_key: str = "weight_scale"
    aux_keys: tuple[str, ...] = ()
    actorder: str | None = None  # GPTQ act-order: 'weight' (stored in order) or 'group' (weight_g_idx)
    zero_point_key: str | None = None
    layout: str = ROWS

    @property
    def quant(self) -> QuantScheme:
        return get_scheme(self.scheme)

    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, int]:
        """The linear's logical [rows, cols] from its stored weight's 2-D shape."""
        if self.layout == AWQ_GEMM:  # [cols, rows / 8]
            return stored[1] * 8, stored[0]
        rows, cols = self.quant.logical_shape(stored)
        return rows, cols

    def weight_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        """The stored weight's shape for a linear of logical [rows, cols] (packed int4: 8 columns an int32)."""
        if self.layout == AWQ_GEMM:
            return (shape[1], shape[0] // 8)
        return self.quant.stored_shape(shape)

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        """The stored scale's shape for a linear of logical [rows, cols]: compressed-tensors keeps a
        per-tensor scale as one value [1] (the artifact repeats it on every row); AutoAWQ [groups, rows]."""
        if self.quant.per_tensor:
            return (1,)
        scale = self.quant.scale_shape(shape)
        assert scale is not None
        return scale[::-1] if self.layout == AWQ_GEMM else scale

    def zero_point_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The stored (packed int32) zero points' shape for a linear of logical [rows, cols]:
        compressed-tensors [ceil(rows / 8), groups], AutoAWQ [groups, rows / 8]."""
        assert self.quant.int4 is not None
        groups = shape[1] // self.quant.int4.group_size
        return (groups, shape[0] // 8) if self.layout == AWQ_GEMM else (-(-shape[0] // 8), groups)

    def describe(self) -> str:
        """One line for people: the method, format and what it holds."""
        order = f", act-order {self.actorder!r}" if self.actorder else ""
        return f"{self.method} {self.format}{order}: {WHAT[self.scheme]}"

    def to_dict(self) -> dict[str, Any]:
        """What the manifest records of the source's quantization (`source.quantization`)."""
        return {"method": self.method, "format": self.format, "scheme": self.scheme} | (
            {"actorder": self.actorder} if self.actorder else {}
        )
