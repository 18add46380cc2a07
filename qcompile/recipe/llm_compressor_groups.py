"""An llm-compressor modifier's `config_groups` (compressed-tensors QuantizationScheme fields) read as
the preset it spells out, or refused naming the field.

Only the W4A16 preset's scheme is recognised: one group targeting Linear, weights int, 4 bits,
symmetric, `strategy: group`, `group_size: 128`, static, no act-order, no activation quantization.
The FP8 presets are taken by name (`scheme: FP8_DYNAMIC`); their config_groups are refused.
"""

from __future__ import annotations

from typing import Any

from qruntime.shown import shown

from qcompile.errors import RecipeError

# (key, what W4A16 has, the values that mean it: compressed-tensors' default when the key is absent)
_W4A16_WEIGHTS = (
    ("num_bits", "4", (4,)),
    ("type", "int", ("int", None)),
    ("symmetric", "true (zero points, asymmetric int4, are not supported)", (True, None)),
    ("group_size", "128", (128,)),
    ("strategy", "group", ("group", None)),  # compressed-tensors infers group from group_size
    ("dynamic", "false", (False, None)),
    ("actorder", "null (act-order is GPTQ's)", (None,)),
    ("block_structure", "null", (None,)),
    ("scale_dtype", "null", (None,)),
    ("zp_dtype", "null", (None,)),
    ("observer", "minmax or memoryless_minmax (round to nearest)", ("minmax", "memoryless_minmax", None)),
    ("observer_kwargs", "{}", ({}, None)),
)
_GROUP_KEYS = frozenset({"targets", "weights", "input_activations", "output_activations", "format"})
_FORMATS = (None, "pack-quantized")


def config_groups_preset(groups: Any, where: str, source: str) -> str:
    """ "W4A16" when `groups` (a modifier's config_groups, at `where` in `source`) is its scheme."""
    if not isinstance(groups, dict) or len(groups) != 1:
        raise RecipeError(
            f"{source}: {where} must hold exactly one group (several config groups are not supported), "
            f"got {shown(groups)}"
        )
    ((name, group),) = groups.items()
    where = f"{where}.{name if isinstance(name, str) and len(name) <= 40 else shown(name, 40)}"
    if not isinstance(group, dict):
        raise RecipeError(f"{source}: {where} must be a mapping (targets, weights, ...), got {shown(group)}")
    unknown = [k for k in group if k not in _GROUP_KEYS]
    if unknown:
        raise RecipeError(
            f"{source}: {where}.{shown(unknown[0], 40)} is not supported (supported: {', '.join(sorted(_GROUP_KEYS))})"
        )
    targets = group.get("targets")
    if (targets if isinstance(targets, list) else [targets]) != ["Linear"]:
        raise RecipeError(f"{source}: {where}.targets must be [Linear] (got {shown(targets)})")
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise RecipeError(
                f"{source}: {where}.{key} is not supported: activation quantization is not translated from "
                "config_groups (W4A16 only: activations stay in the model dtype)"
            )
    if group.get("format") not in _FORMATS:
        raise RecipeError(f"{source}: {where}.format {shown(group.get('format'))} is not supported (pack-quantized)")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise RecipeError(
            f"{source}: {where}.weights must be a mapping of quantization arguments, got {shown(weights)}"
        )
    known = {key for key, _, _ in _W4A16_WEIGHTS}
    unknown = [k for k in weights if k not in known]
    if unknown:
        raise RecipeError(f"{source}: {where}.weights.{shown(unknown[0], 40)} is not supported")
    for key, wanted, accepted in _W4A16_WEIGHTS:
        value = weights.get(key)
        if not any(value == a and type(value) is type(a) for a in accepted):
            raise RecipeError(
                f"{source}: {where}.weights.{key} {shown(value)} is not supported: config_groups are translated "
                f"for W4A16 only ({key}: {wanted})"
            )
    return "W4A16"
