"""Pre-quantized checkpoints: config.json's `quantization_config` read into the format its weights are stored in.

A checkpoint that llm-compressor wrote (`quant_method: compressed-tensors`, `quantization_status:
compressed`) stores each quantized linear as the artifact of one of our schemes stores it, byte for
byte: FP8 `weight` + `weight_scale` (float-quantized) or packed int4 `weight_packed` + `weight_scale`
(+ `weight_shape`, pack-quantized). Such a checkpoint is transcoded, never re-quantized: the
compiler copies those tensors into the artifact (qcompile.source.stored reads and checks them).

`read_format` accepts exactly the configs qcompile writes itself (qcompile.recipe.quant_config): one
config group targeting Linear whose weights and input activations are those of one of our schemes.
Anything else (static activation scales, act-order, asymmetric int4, several groups, a quantized KV
cache, sparsity or transforms) is a CheckpointError saying what the config holds and what is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qruntime.shown import shown

from qcompile.errors import CheckpointError
from qcompile.quant import QuantScheme, get_scheme
from qcompile.quant.schemes import PerBlock, PerChannel, PerGroupInt4, PerTensor

COMPRESSED_TENSORS = "compressed-tensors"
SCHEMES = ("ptpc-fp8", "tensor-fp8", "block-fp8", "w4a16")  # the schemes a stored checkpoint can be in
# compressed-tensors' defaults for the QuantizationArgs fields compared below
_ARG_DEFAULTS = {"symmetric": True, "dynamic": False, "group_size": None, "block_structure": None, "actorder": None}
_WEIGHT_KEYS = ("num_bits", "type", "strategy", "symmetric", "dynamic", "group_size", "block_structure", "actorder")
_ACTIVATION_KEYS = ("num_bits", "type", "strategy", "symmetric", "dynamic", "group_size")


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
        return f"{self.method} {self.format}: {_WHAT[self.scheme]}"

    def to_dict(self) -> dict[str, Any]:
        """What the manifest records of the source's quantization (`source.quantization`)."""
        return {"method": self.method, "format": self.format, "scheme": self.scheme}


_WHAT = {
    "ptpc-fp8": "FP8 weights, one scale per output channel; activations FP8 per token (llm-compressor FP8_DYNAMIC)",
    "tensor-fp8": "FP8 weights, one scale per tensor; activations FP8 per tensor, dynamic",
    "block-fp8": "FP8 weights in 128x128 blocks; activations FP8 in groups of 128 (llm-compressor FP8_BLOCK)",
    "w4a16": "int4 weights, symmetric, one scale per 128 input columns; activations unquantized (llm-compressor W4A16)",
}


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
        return {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": w.group_size}, None
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
    if method != COMPRESSED_TENSORS:
        raise CheckpointError(
            f"{where}.quant_method {shown(method)} is not supported; qcompile reads pre-quantized checkpoints in "
            f"llm-compressor's {COMPRESSED_TENSORS!r} format ({', '.join(_WHAT[s] for s in SCHEMES[:1])}, …), "
            "or compile the unquantized (bf16) checkpoint"
        )
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
    scheme = _match_scheme(weights, activations, at)
    fmt = group.get("format") or qc.get("format")
    want = "pack-quantized" if scheme.int4 else "float-quantized"
    if fmt != want:
        raise CheckpointError(f"{at}.format is {shown(fmt)}; {_WHAT[scheme.name]} is stored as {want!r}")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise CheckpointError(f"{where}.ignore must be a list of module names or 're:' patterns")
    if scheme.int4:
        return StoredFormat(method, fmt, scheme.name, tuple(ignore), "weight_packed", aux_keys=("weight_shape",))
    return StoredFormat(method, fmt, scheme.name, tuple(ignore))


def _match_scheme(weights: dict[str, Any], activations: dict[str, Any] | None, at: str) -> QuantScheme:
    """Our scheme whose weights and activations the group's are, or a CheckpointError saying why none is."""
    found_w, found_a = _args(weights, _WEIGHT_KEYS), _args(activations, _ACTIVATION_KEYS)
    for name in SCHEMES:
        scheme = get_scheme(name)
        want_w, want_a = _expected(scheme)
        if _matches(found_w, want_w, _WEIGHT_KEYS) and _matches(found_a, want_a, _ACTIVATION_KEYS):
            return scheme
    reason = ""
    if found_w.get("actorder") is not None:
        reason = " (act-order weights, with g_idx, are not read yet)"
    elif found_a is not None and not found_a.get("dynamic"):
        reason = (
            " (static activation scales, input_scale, are not supported: qcompile quantizes activations at run time)"
        )
    elif found_w.get("type") == "int" and not found_w.get("symmetric"):
        reason = " (asymmetric int weights, with zero points, are not supported)"
    supported = "; ".join(f"{n}: {_WHAT[n]}" for n in SCHEMES)
    raise CheckpointError(
        f"{at}: weights {shown(found_w)} with input_activations {shown(found_a)} match no qcompile scheme{reason}. "
        f"Supported: {supported}"
    )
