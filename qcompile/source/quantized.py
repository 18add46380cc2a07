"""Pre-quantized checkpoints: config.json's `quantization_config` read into the format its weights are stored in.

Each `quant_method` qcompile reads has a reader returning a StoredFormat (qcompile.source.stored_format):
llm-compressor's compressed-tensors (FP8 per channel / tensor / block, W4A16 pack-quantized, symmetric
or with zero points), Qwen's own FP8 checkpoints (`fp8`, 128x128 blocks) and AutoAWQ's GEMM checkpoints
(`awq`, int4 with zero points). The checkpoint's quantized linears are then
copied into the artifact of the matching scheme, never re-quantized (qcompile.source.stored).
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from qruntime.shown import shown

from qcompile.errors import CheckpointError
from qcompile.source import awq, compressed_tensors, qwen_fp8
from qcompile.source.stored_format import SCHEMES, StoredFormat

__all__ = ["READERS", "SCHEMES", "StoredFormat", "read_format"]

READERS: MappingProxyType[str, Callable[[dict[str, Any], str], StoredFormat]] = MappingProxyType(
    {
        compressed_tensors.METHOD: compressed_tensors.read_compressed_tensors,
        qwen_fp8.METHOD: qwen_fp8.read_qwen_fp8,
        awq.METHOD: awq.read_awq,
    }
)


def read_format(config: dict[str, Any], source: str = "config.json") -> StoredFormat | None:
    """The stored format of a pre-quantized checkpoint's config, or None when it has no
    quantization_config (weights in the model dtype). Errors name the key at fault and say what is read."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where} must be an object, got {shown(qc)}")
    method = qc.get("quant_method")
    reader = READERS.get(method) if isinstance(method, str) else None
    if reader is None:
        raise CheckpointError(
            f"{where}.quant_method {shown(method)} is not supported; qcompile reads pre-quantized checkpoints "
            f"of quant_method {' or '.join(repr(m) for m in READERS)} (llm-compressor's compressed-tensors, Qwen's "
            "FP8, AutoAWQ GEMM); compile the unquantized (bf16) checkpoint instead"
        )
    return reader(qc, where)
