"""`qcompile eval-recipes CKPT --data FILE -r bf16 -r ptpc-fp8 …`: compile a checkpoint with each
recipe and evaluate every artifact against the same reference, in one table."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import click

from qcompile.commands.eval import data_line, eval_options
from qcompile.errors import PlanError, RecipeError


@click.command("eval-recipes")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option(
    "-r",
    "--recipe",
    "recipes",
    multiple=True,
    required=True,
    help="A shipped recipe name or a recipe YAML file; repeat it for each row, in order.",
)
@click.option(
    "--reference",
    type=click.Path(path_type=Path),
    default=None,
    help="The reference model [default: CHECKPOINT, run by transformers]; a bf16 artifact runs on qruntime.",
)
@click.option(
    "--workdir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="Directory for the temporary artifacts [default: the system's temporary directory].",
)
@click.option(
    "--calib",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Calibration text for recipes with a calibrated fp8 KV cache (ptpc-fp8-kv8) or AWQ scales (w4a16-awq); "
    "keep it apart from --data.",
)
@eval_options
def command(
    checkpoint, recipes, reference, workdir, calib, data, window, max_tokens, device, dtype, as_json, no_progress
):
    """Compare recipes on CHECKPOINT side by side.

    Every recipe is validated against the checkpoint first; then each is compiled in turn into a
    temporary directory, evaluated on --data against the same reference (as `qcompile eval`) and
    removed before the next. The temporary artifacts are removed on any error or Ctrl-C too.

        qcompile eval-recipes ./Qwen3-8B --data heldout.txt -r bf16 -r ptpc-fp8 -r ptpc-fp8-lmhead -r block-fp8 \
            -r ptpc-fp8-kv8 --calib calib.txt
    """
    from qcompile.compile.pipeline import compile_checkpoint, prepare
    from qcompile.evaluate.accuracy import evaluate, open_reference, read_text, resolve_device, resolve_dtype
    from qcompile.recipe.schema import load_recipe

    if len(set(recipes)) != len(recipes):
        raise RecipeError(f"a recipe is listed twice: {', '.join(recipes)}")
    progress = not no_progress
    read_text(data)  # a bad data file fails before anything is compiled
    prepared = []
    for name in recipes:  # every recipe checked against the checkpoint before anything is compiled
        try:
            recipe = load_recipe(name)
            prepared.append(prepare(checkpoint, recipe, calib if recipe.needs_calib else None, progress=progress))
        except (RecipeError, PlanError) as exc:
            raise type(exc)(f"recipe {name!r}: {exc}") from exc
    compute_dtype = resolve_dtype(dtype)
    ref = open_reference(reference or checkpoint, resolve_device(device), compute_dtype, window, progress)
    workers = max(1, len(os.sched_getaffinity(0)))
    rows = []
    with tempfile.TemporaryDirectory(prefix="qcompile-eval-", dir=workdir) as tmp:
        for index, (name, plan) in enumerate(zip(recipes, prepared, strict=True)):
            if progress:
                click.echo(f"[{index + 1}/{len(recipes)}] {name}: compile, evaluate", err=True)
            artifact = Path(tmp) / f"{index}-{plan.recipe.name}"
            compile_checkpoint(plan, artifact, workers=workers, progress=progress, source_label=str(checkpoint))
            result = evaluate(
                artifact,
                ref,
                data,
                window=window,
                max_tokens=max_tokens,
                device=device,
                dtype=compute_dtype,
                progress=progress,
            )
            shutil.rmtree(artifact)  # one artifact on disk at a time
            rows.append((name, result))

    if as_json:
        first = rows[0][1]
        summary = {
            "checkpoint": str(checkpoint),
            "reference": first.reference,
            "reference_kind": first.reference_kind,
            "data": first.data,
            "device": first.device,
            "dtype": first.dtype,
            "window": first.window,
            "windows": first.windows,
            "tokens": first.tokens,
            "ppl_reference": first.ppl_reference,
            "rows": [{"recipe": name, "recipe_name": r.recipe} | _metrics(r.to_dict()) for name, r in rows],
        }
        click.echo(json.dumps(summary))
        return
    first = rows[0][1]
    click.echo(f"reference  {first.reference} ({first.reference_kind}, {first.dtype}, ppl {first.ppl_reference:.4f})")
    click.echo(f"data       {data_line(first)}")
    width = max(6, *(len(name) for name, _ in rows))
    click.echo(f"{'recipe':<{width}}  {'ppl':>10}  {'ppl ratio':>9}  {'KL nats/tok':>11}  {'top-1':>7}")
    for name, r in rows:
        click.echo(
            f"{name:<{width}}  {r.ppl_artifact:>10.4f}  {r.ppl_ratio:>9.5f}  {r.kl:>11.3e}  "
            f"{100 * r.top1_agreement:>6.2f}%"
        )


def _metrics(result: dict) -> dict:
    """A result less what the summary holds once and the temporary artifact's path (removed by now)."""
    shared = ("artifact", "recipe", "reference", "reference_kind", "data", "device", "dtype", "window", "windows")
    return {key: value for key, value in result.items() if key not in (*shared, "tokens", "ppl_reference")}
