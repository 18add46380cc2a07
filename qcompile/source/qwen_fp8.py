"""Qwen's own FP8 checkpoints (`quant_method: fp8`, the Qwen/Qwen3-*-FP8 releases) read into a StoredFormat.

Their layout, as published: each quantized linear holds `weight` (float8_e4m3fn [rows, cols]) and
`weight_scale_inv` ([ceil(rows/128), ceil(cols/128)], the model dtype), one scale per 128x128 block
by which the FP8 values are multiplied (the name notwithstanding, it is the dequantization scale,
as compressed-tensors' block `weight_scale` is); activations are quantized at run time in groups of
128 (`activation_scheme: dynamic`). That is our block-fp8 artifact, so the tensors are copied as they
are. Modules left unquantized are those of `modules_to_not_convert` (matched anywhere in a module
name, as transformers does), lm_head (which transformers never converts) and the MoE routers.
"""

from __future__ import annotations

import re
from typing import Any

from qruntime.shown import shown

from qcompile.errors import CheckpointError
from qcompile.source.stored_format import StoredFormat

METHOD = "fp8"
SCHEME = "block-fp8"
BLOCK = [128, 128]
_KEYS = frozenset({"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"})


def read_qwen_fp8(qc: dict[str, Any], where: str) -> StoredFormat:
    """The StoredFormat of a `quant_method: fp8` quantization_config `qc` (`where` names it in errors)."""
    unknown = sorted(str(k) for k in qc if k not in _KEYS)
    if unknown:
        raise CheckpointError(
            f"{where}.{shown(unknown[0], 60)} is not read for quant_method 'fp8' (read: {', '.join(sorted(_KEYS))})"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}.fmt is {shown(qc['fmt'])}; only 'e4m3' (float8_e4m3fn) weights are read")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(
            f"{where}.activation_scheme is {shown(qc['activation_scheme'])}: static activation scales are not "
            "supported (qcompile quantizes activations at run time, 'dynamic')"
        )
    block = qc.get("weight_block_size")
    if block != BLOCK:
        raise CheckpointError(
            f"{where}.weight_block_size is {shown(block)}; qcompile reads FP8 blocks of {BLOCK} (block-fp8), "
            "per-tensor FP8 checkpoints of this method are not read"
        )
    keep = qc.get("modules_to_not_convert") or []
    if not isinstance(keep, list) or not all(isinstance(m, str) and m for m in keep):
        raise CheckpointError(f"{where}.modules_to_not_convert must be a list of module names, got {shown(keep)}")
    ignore = ("lm_head", *(f"re:.*{re.escape(m)}" for m in keep))
    return StoredFormat(METHOD, "e4m3 128x128 blocks", SCHEME, ignore, scale_key="weight_scale_inv")
