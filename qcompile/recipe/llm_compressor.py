"""Translate an llm-compressor recipe (a QuantizationModifier with an FP8 preset) into ours.

llm-compressor recipes nest modifiers under stages, e.g.

    default_stage:
      default_modifiers:
        QuantizationModifier: {targets: [Linear], ignore: [lm_head], scheme: FP8_DYNAMIC}

The scheme maps to one of our schemes and the `ignore` list is kept as is (same matching rules:
exact module names or `re:` regexes). Anything we cannot honour exactly is an error, not a guess.
"""

from __future__ import annotations

from typing import Any

from qruntime.shown import shown

from qcompile.errors import RecipeError


def _presets() -> dict[str, str]:
    """llm-compressor preset -> our scheme, from the schemes' own byte-compatibility records."""
    from qcompile.quant import SCHEMES

    return {s.llmcompressor_scheme: name for name, s in SCHEMES.items() if s.llmcompressor_scheme}


_SUPPORTED_KEYS = frozenset({"targets", "ignore", "scheme"})


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
    others = [(w, n) for w, n, _ in modifiers if n != "QuantizationModifier"]
    if others:
        where, name = others[0]
        raise RecipeError(
            f"{source}: {where}: {name} is not supported; only a QuantizationModifier with "
            f"scheme {' or '.join(_presets())} can be translated"
        )
    if len(modifiers) != 1:
        raise RecipeError(f"{source}: found {len(modifiers)} QuantizationModifiers; expected exactly one")
    where, _, args = modifiers[0]
    presets = _presets()
    if not isinstance(args, dict):
        raise RecipeError(f"{source}: {where} must be a mapping of arguments")
    unknown = [k for k in args if k not in _SUPPORTED_KEYS]
    if unknown:
        raise RecipeError(
            f"{source}: {where}.{_key(unknown[0])} is not supported when translating "
            f"(supported: {', '.join(sorted(_SUPPORTED_KEYS))})"
        )
    scheme, targets = args.get("scheme"), args.get("targets", ["Linear"])
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
    return {
        "description": f"translated from llm-compressor {scheme} recipe {source}",
        "quantization": {"scheme": presets[scheme], "ignore": ignore},
    }
