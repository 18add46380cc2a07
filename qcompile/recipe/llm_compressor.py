"""Translate an llm-compressor recipe into ours: a QuantizationModifier with a preset our schemes
match byte for byte (FP8_DYNAMIC, FP8_BLOCK, W4A16), or an AWQModifier with W4A16 (`w4a16-awq`).

llm-compressor recipes nest modifiers under stages, e.g.

    default_stage:
      default_modifiers:
        AWQModifier: {duo_scaling: true}
        QuantizationModifier: {targets: [Linear], ignore: [lm_head], scheme: W4A16}

The scheme is a preset's name or `config_groups` that spell one out (llm_compressor_groups.py); the
`ignore` list is kept as is (same matching rules: exact module names or `re:` regexes); the
AWQModifier's own arguments are read by llm_compressor_awq.py. Anything we cannot honour exactly is
an error naming the file, the modifier and the field, not a guess.
"""

from __future__ import annotations

from typing import Any

from qruntime.shown import shown

from qcompile.errors import RecipeError
from qcompile.recipe.llm_compressor_awq import AWQ_KEYS, translate_awq_arguments
from qcompile.recipe.llm_compressor_groups import config_groups_preset


def _presets() -> dict[str, str]:
    """llm-compressor preset -> our scheme, from the schemes' own byte-compatibility records."""
    from qcompile.quant import SCHEMES

    return {s.llmcompressor_scheme: name for name, s in SCHEMES.items() if s.llmcompressor_scheme}


_QUANT_KEYS = frozenset({"targets", "ignore", "scheme", "config_groups"})
_TRANSLATED = ("QuantizationModifier", "AWQModifier")


def _modifiers(node: Any, path: str) -> list[tuple[str, str, Any]]:
    """(path, modifier name, its arguments) for every `...Modifier` key under node."""
    found: list[tuple[str, str, Any]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{_key(key)}" if path else _key(key)
            if isinstance(key, str) and key.endswith("Modifier"):
                found.append((where, key, value))
            else:
                found.extend(_modifiers(value, where))
    return found


def _key(key: object) -> str:
    """A mapping key as it appears in an error's path: bounded whatever it holds."""
    return key if isinstance(key, str) and len(key) <= 40 else shown(key, 40)


def is_llmcompressor_recipe(raw: dict[str, Any]) -> bool:
    return bool(_modifiers(raw, ""))


def translate_llmcompressor_recipe(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Our recipe dict (defaults for everything llm-compressor does not say) from theirs."""
    modifiers = _modifiers(raw, "")
    others = [(w, n) for w, n, _ in modifiers if n not in _TRANSLATED]
    if others:
        where, name = others[0]
        raise RecipeError(
            f"{source}: {where}: {name} is not supported; only a QuantizationModifier with scheme "
            f"{' or '.join(_presets())}, or an AWQModifier with W4A16, can be translated"
        )
    awq = [m for m in modifiers if m[1] == "AWQModifier"]
    quant = [m for m in modifiers if m[1] == "QuantizationModifier"]
    if awq:
        return _translate_awq(awq, quant, modifiers, source)
    if len(quant) != 1:
        raise RecipeError(f"{source}: found {len(quant)} QuantizationModifiers; expected exactly one")
    where, _, args = quant[0]
    scheme, ignore = _quantization(_arguments(args, where, source, _QUANT_KEYS), where, source)
    return {
        "description": f"translated from llm-compressor {scheme} recipe {source}",
        "quantization": {"scheme": _presets()[scheme], "ignore": ignore},
    }


def _translate_awq(awq: list, quant: list, modifiers: list, source: str) -> dict[str, Any]:
    """`w4a16-awq` from an AWQModifier and the QuantizationModifier after it, or from an AWQModifier
    that quantizes itself (llm-compressor's older form, which its compatibility shim splits into the
    two: the quantization keys go to a QuantizationModifier)."""
    if len(awq) > 1:
        raise RecipeError(f"{source}: found {len(awq)} AWQModifiers ({awq[0][0]}, {awq[1][0]}); expected at most one")
    where, _, args = awq[0]
    if args is None:  # `AWQModifier:` with nothing after it: all its defaults
        args = {}
    own = [k for k in args if k in _QUANT_KEYS] if isinstance(args, dict) else []
    args = _arguments(args, where, source, AWQ_KEYS | _QUANT_KEYS if own else AWQ_KEYS)
    if own:
        if quant:
            raise RecipeError(
                f"{source}: {where}.{own[0]} and {quant[0][0]} both say how to quantize; give the scheme in one of them"
            )
        q_where, q_args = where, {k: args[k] for k in own}
    else:
        if len(quant) != 1:
            raise RecipeError(
                f"{source}: {where} smooths the weights for a QuantizationModifier (scheme W4A16) after it, or "
                f"for its own scheme; found {len(quant)} QuantizationModifiers and no {where}.scheme"
            )
        q_where, _, q_args = quant[0]
        if modifiers.index(quant[0]) < modifiers.index(awq[0]):
            raise RecipeError(
                f"{source}: {q_where} comes before {where}; the AWQModifier must come first (it scales the weights "
                "the QuantizationModifier then rounds)"
            )
        q_args = _arguments(q_args, q_where, source, _QUANT_KEYS)
    scheme, ignore = _quantization(q_args, q_where, source)
    if _presets()[scheme] != "w4a16":
        raise RecipeError(
            f"{source}: {q_where}.scheme {scheme} is not supported with {where}: AWQ is translated for W4A16 only "
            "(int4, symmetric, groups of 128: w4a16-awq)"
        )
    mappings = translate_awq_arguments({k: v for k, v in args.items() if k in AWQ_KEYS}, where, source)
    quantization = {"scheme": "w4a16", "method": "awq", "ignore": ignore}
    if mappings != "auto":
        quantization["awq_mappings"] = mappings
    return {
        "description": f"translated from llm-compressor AWQModifier {scheme} recipe {source}",
        "quantization": quantization,
    }


def _arguments(args: Any, where: str, source: str, supported: frozenset[str]) -> dict[str, Any]:
    """A modifier's arguments: a mapping of supported keys only."""
    if not isinstance(args, dict):
        raise RecipeError(f"{source}: {where} must be a mapping of arguments")
    unknown = [k for k in args if k not in supported]
    if unknown:
        raise RecipeError(
            f"{source}: {where}.{_key(unknown[0])} is not supported when translating "
            f"(supported: {', '.join(sorted(supported))})"
        )
    return args


def _quantization(args: dict[str, Any], where: str, source: str) -> tuple[str, list[str]]:
    """(the llm-compressor preset, the ignore list) of a modifier's quantization arguments."""
    presets = _presets()
    scheme, targets = args.get("scheme"), args.get("targets", ["Linear"])
    if "config_groups" in args:
        if scheme is not None:
            raise RecipeError(f"{source}: {where}: give scheme or config_groups, not both")
        scheme = config_groups_preset(args["config_groups"], f"{where}.config_groups", source)
    if isinstance(scheme, dict):
        if len(scheme) != 1:
            raise RecipeError(f"{source}: {where}.scheme must name exactly one preset")
        ((scheme, targets),) = scheme.items()
    if not isinstance(scheme, str) or scheme not in presets:
        raise RecipeError(f"{source}: {where}.scheme {shown(scheme)} is not supported; supported: {', '.join(presets)}")
    if isinstance(targets, str):
        targets = [targets]
    if targets != ["Linear"]:
        raise RecipeError(f"{source}: {where}.targets must be [Linear] (got {shown(targets)})")
    ignore = args.get("ignore", [])
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise RecipeError(f"{source}: {where}.ignore must be a list of module names or 're:' patterns")
    return scheme, ignore
