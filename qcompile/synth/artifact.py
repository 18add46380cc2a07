"""Synthetic artifacts: a preset's real graph, manifest and tokenizer, compiled from a sparse
checkpoint, with sparse weight files; the runtime makes random weights on the device at load.

They measure the runtime at full model scale (qwen3-235b-a22b over several GPUs) where neither the
checkpoint nor its artifact could be downloaded or stored. The manifest's `synthetic` entry says
so, `qcompile verify` / `publish` / `export` refuse them, and `qruntime.load` labels the engine.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import Recipe, RecipeError
from qcompile.synth.sparse import write_sparse_checkpoint


def write_synthetic_artifact(
    preset: str,
    output: str | Path,
    recipe: Recipe,
    *,
    tp: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Compile PRESET's sparse checkpoint under `recipe` (at `tp` ranks when given) into a synthetic
    artifact at `output`; returns its manifest."""
    if tp is not None:
        recipe = dataclasses.replace(recipe, tp=tp)
    if recipe.kv_cache.calibrate:
        raise RecipeError(f"recipe {recipe.name!r} calibrates its KV cache on text; a synthetic artifact cannot")
    output = Path(output)
    output.absolute().parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".qcompile-synth-", dir=output.absolute().parent) as tmp:
        checkpoint = Path(tmp) / preset
        write_sparse_checkpoint(preset, checkpoint)
        synthetic = {
            "preset": preset,
            "weights": "random, generated on the device at load; the weight files are sparse (all zero)",
        }
        return compile_checkpoint(
            prepare(checkpoint, recipe),
            output,
            force=force,
            progress=progress,
            source_label=f"synthetic {preset}",
            synthetic=synthetic,
        )
