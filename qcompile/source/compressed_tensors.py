"""llm-compressor's `compressed-tensors` quantization_config read into a StoredFormat.

A checkpoint it wrote (`quantization_status: compressed`) stores each quantized linear as the
artifact of one of our schemes stores it, byte for byte: FP8 `weight` + `weight_scale`
(float-quantized) or packed int4 `weight_packed` + `weight_scale` + `weight_shape` (pack-quantized),
asymmetric int4 (`symmetric: false`) adding `weight_zero_point`, int32 [ceil(rows / 8), groups]:
the zero points (signed, stored + 8 as the weights are) packed eight rows of a group to a word.
Accepted are exactly the configs qcompile writes itself (qcompile.recipe.quant_config): one config
group targeting Linear whose weights and input activations are those of one of our schemes.
Anything else (static activation scales, several groups, a quantized KV cache, sparsity or
transforms) is a CheckpointError saying what the config holds and what is read.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from qruntime.shown import shown

from qcompile.errors import CheckpointError
from qcompile.quant import QuantScheme, get_scheme
from qcompile.quant.schemes import PerBlock, PerChannel, PerGroupInt4, PerTensor
from qcompile.source.stored_format import SCHEMES, WHAT, StoredFormat

METHOD = "compressed-tensors"
# compressed-tensors' defaults for the QuantizationArgs fields compared below
_ARG_DEFAULTS = MappingProxyType(
    {"symmetric": True, "dynamic": False, "group_size": None, "block_structure": None, "actorder": None}
)
_WEIGHT_KEYS = ("num_bits", "type", "strategy", "symmetric", "dynamic", "group_size", "block_structure", "actorder")
_ACTIVATION_KEYS = ("num_bits", "type", "strategy", "symmetric", "dynamic", "group_size")
ACTORDERS = ("weight", "group")  # GPTQ's activation ordering, by its canonical names
ACTORDER_ALIASES = MappingProxyType({"static": "weight", "dynamic": "group"})


def _expected(scheme: QuantScheme) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The weights' and input activations' QuantizationArgs fields a compressed-tensors config holds
    for `scheme` (those qcompile.recipe.quant_config writes for it)."""
    w = scheme.weights
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    if isinstance(w, PerChannel):
        return {**fp8, "strategy": "channel"}, {**fp8, "strategy": "token", "dynamic": True}
    if isinstance(w, PerTensor):
        return {**fp8, "strategy": "tensor"}, {**fp8, "strategy": "tensor", "dynamic": True}
    if isinstance(w, PerBlock):
        block = {"strategy": "block", "block_structure": [w.block_n, w.block_k]}
        return {**fp8, **block}, {**fp8, "strategy": "group", "group_size": scheme.activation_group, "dynamic": True}
    if isinstance(w, PerGroupInt4):
        symmetric = not w.zero_point
        return {
            "num_bits": 4,
            "type": "int",
            "symmetric": symmetric,
            "strategy": "group",
            "group_size": w.group_size,
        }, None
    raise ValueError(f"scheme {scheme.name!r} is not a quantized scheme")


def _args(raw: Any, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """The compared fields of a QuantizationArgs object (defaults filled in), None for null."""
    if raw is None:
        return None
    return {k: raw.get(k, _ARG_DEFAULTS.get(k)) for k in keys}


def _matches(found: dict[str, Any] | None, want: dict[str, Any] | None, keys: tuple[str, ...]) -> bool:
    if found is None or want is None:
        return found is None and want is None
    full = {k: want.get(k, _ARG_DEFAULTS.get(k)) for k in keys}
    return found == full


def read_compressed_tensors(qc: dict[str, Any], where: str) -> StoredFormat:
    """The StoredFormat of a compressed-tensors quantization_config `qc` (`where` names it in errors)."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise CheckpointError(
            f"{where}.quantization_status is {shown(status)}: only 'compressed' checkpoints (quantized tensors "
            "on disk, as save_pretrained(save_compressed=True) writes them) are read"
        )
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            raise CheckpointError(
                f"{where}.{key} is set ({shown(qc[key])}); qcompile reads quantized linear weights only — compile "
                "the unquantized checkpoint instead (a recipe such as ptpc-fp8-kv8 quantizes the KV cache)"
            )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        count = len(groups) if isinstance(groups, dict) else shown(groups)
        raise CheckpointError(f"{where}.config_groups must hold exactly one scheme for every Linear, got {count}")
    ((name, group),) = groups.items()
    at = f"{where}.config_groups.{shown(name, 40)}"
    if not isinstance(group, dict):
        raise CheckpointError(f"{at} must be an object, got {shown(group)}")
    if group.get("targets") != ["Linear"]:
        raise CheckpointError(f"{at}.targets must be ['Linear'], got {shown(group.get('targets'))}")
    if group.get("output_activations") is not None:
        raise CheckpointError(f"{at}.output_activations must be null (output quantization is not supported)")
    weights, activations = group.get("weights"), group.get("input_activations")
    if not isinstance(weights, dict) or not (activations is None or isinstance(activations, dict)):
        raise CheckpointError(f"{at}: 'weights' must be an object and 'input_activations' an object or null")
    raw = weights.get("actorder")
    actorder = ACTORDER_ALIASES.get(raw, raw) if isinstance(raw, str) else raw
    if actorder is not None and (actorder not in ACTORDERS or weights.get("strategy") != "group"):
        raise CheckpointError(
            f"{at}.weights.actorder {shown(raw)} is not read: act-order is "
            f"{' or '.join(ACTORDERS)} on group-quantized int weights"
        )
    # act-order 'weight' changes only how GPTQ calibrates: stored as without it; 'group' adds weight_g_idx
    scheme = _match_scheme({**weights, "actorder": None}, activations, at)
    fmt = group.get("format") or qc.get("format")
    want = "pack-quantized" if scheme.int4 else "float-quantized"
    if fmt != want:
        raise CheckpointError(f"{at}.format is {shown(fmt)}; {WHAT[scheme.name]} is stored as {want!r}")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise CheckpointError(f"{where}.ignore must be a list of module names or 're:' patterns")
    if scheme.int4:
        aux = ("weight_shape", "weight_g_idx") if actorder == "group" else ("weight_shape",)
        zero_point = "weight_zero_point" if scheme.zero_point else None
        return StoredFormat(
            METHOD,
            fmt,
            scheme.name,
            tuple(ignore),
            "weight_packed",
            aux_keys=aux,
            actorder=actorder,
            zero_point_key=zero_point,
        )
    return StoredFormat(METHOD, fmt, scheme.name, tuple(ignore))


def _match_scheme(weights: dict[str, Any], activations: dict[str, Any] | None, at: str) -> QuantScheme:
    """Our scheme whose weights and activations the group's are, or a CheckpointError saying why none is."""
    found_w, found_a = _args(weights, _WEIGHT_KEYS), _args(activations, _ACTIVATION_KEYS)
    for name in SCHEMES:
        scheme = get_scheme(name)
        want_w, want_a = _expected(scheme)
        if _matches(found_w, want_w, _WEIGHT_KEYS) and _matches(found_a, want_a, _ACTIVATION_KEYS):
            return scheme
    reason = ""
    if found_a is not None and not found_a.get("dynamic"):
        reason = (
            " (static activation scales, input_scale, are not supported: qcompile quantizes activations at run time)"
        )
    elif found_w.get("type") == "int" and not found_w.get("symmetric"):
        reason = " (asymmetric int weights, with zero points, are read as 4-bit groups of 128 only: w4a16-zp)"
    supported = "; ".join(f"{n}: {WHAT[n]}" for n in SCHEMES)
    raise CheckpointError(
        f"{at}: weights {shown(found_w)} with input_activations {shown(found_a)} match no qcompile scheme{reason}. "
        f"Supported: {supported}"
    )
