"""The recipe of a pre-quantized checkpoint: its scheme and ignore list are the checkpoint's.

A checkpoint stored quantized (qcompile.source.quantized) is transcoded, never re-quantized: every
linear it stores quantized keeps its bytes, every linear it keeps in the model dtype stays so. So
the recipe's scheme must be the stored one (`-r w4a16` on an FP8 checkpoint is an error naming
both), and its `quantization.ignore` becomes the names of the linears the checkpoint leaves
unquantized (the routers as one pattern). The rest of the recipe (passes, KV cache, tp, shard size) applies as for any checkpoint.
Without `--recipe`, `qcompile compile` takes the shipped recipe named after the stored scheme.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qcompile.errors import RecipeError
from qcompile.recipe.schema import DEFAULT_RECIPE, QuantizationRecipe, Recipe
from qcompile.source.checkpoint import Checkpoint
from qcompile.source.quantized import read_format
from qcompile.source.spec import load_config
from qcompile.source.stored import linear_modules

IGNORE_KEY = "quantization.ignore"
ROUTER_SUFFIX = ".mlp.gate"
ROUTERS = "re:.*mlp.gate$"  # the shipped recipes' own pattern for the MoE routers


def default_recipe(checkpoint: str | Path) -> str:
    """The recipe `qcompile compile` uses without --recipe: the shipped one named after the scheme a
    pre-quantized checkpoint is stored in (ptpc-fp8, tensor-fp8, block-fp8, w4a16), else DEFAULT_RECIPE.
    Reads config.json only."""
    return _stored_scheme(checkpoint) or DEFAULT_RECIPE


def recipe_for_stored(recipe: Recipe, checkpoint: Checkpoint) -> Recipe:
    """`recipe` with the quantization `checkpoint` is stored in: the same scheme (else a RecipeError
    naming both) and, as its ignore list, the linears the checkpoint keeps in the model dtype."""
    fmt = checkpoint.quantization
    if fmt is None:
        return recipe
    if recipe.quantization.scheme != fmt.scheme:
        raise RecipeError(
            f"recipe {recipe.name!r} quantizes with scheme {recipe.quantization.scheme!r}, but "
            f"{checkpoint.path / 'config.json'} says its weights are already quantized ({fmt.describe()}), "
            f"which is scheme {fmt.scheme!r}: a pre-quantized checkpoint is transcoded, not re-quantized. "
            f"Compile it without --recipe (or with a recipe of scheme {fmt.scheme!r}), or compile the unquantized "
            "checkpoint with this recipe"
        )
    if recipe.kv_cache.calibrate:
        raise RecipeError(
            f"recipe {recipe.name!r} calibrates an fp8 KV cache by running the source model, which is not done "
            f"for a pre-quantized checkpoint ({fmt.describe()}); compile the unquantized checkpoint to calibrate"
        )
    return dataclasses.replace(recipe, quantization=QuantizationRecipe(fmt.scheme, kept_unquantized(checkpoint)))


def kept_unquantized(checkpoint: Checkpoint) -> tuple[str, ...]:
    """The ignore list that keeps exactly the linears `checkpoint` stores in the model dtype: their names,
    all MoE routers as one ROUTERS pattern when none is stored quantized (94 names fewer for a 235B)."""
    linears = linear_modules(checkpoint.spec)
    kept = [m for m in linears if f"{m}.weight" not in checkpoint.stored]
    routers = [m for m in linears if m.endswith(ROUTER_SUFFIX)]
    if routers and all(f"{m}.weight" not in checkpoint.stored for m in routers):
        return (*(m for m in kept if not m.endswith(ROUTER_SUFFIX)), ROUTERS)
    return tuple(kept)


def refuse_ignore_override(overrides: tuple[str, ...] | list[str], checkpoint: str | Path) -> None:
    """RecipeError when `--set quantization.ignore=…` is given for a pre-quantized checkpoint, whose
    stored tensors decide which linears are quantized."""
    keys = [item.partition("=")[0].strip() for item in overrides]
    key = next((k for k in keys if k in (IGNORE_KEY, "quantization")), None)
    if key is None or _stored_scheme(checkpoint) is None:
        return
    raise RecipeError(
        f"--set {key}: {checkpoint} is pre-quantized; which linears are quantized is fixed by its stored "
        "tensors (the artifact keeps those it stores unquantized in the model dtype)"
    )


def _stored_scheme(checkpoint: str | Path) -> str | None:
    """The scheme config.json's quantization_config stores the weights in, None for an unquantized checkpoint."""
    path = Path(checkpoint) / "config.json"
    fmt = read_format(load_config(path), source=str(path))
    return None if fmt is None else fmt.scheme
