"""`qcompile synth PRESET -o DIR`: write a random-weight Qwen3 (or Qwen3-VL) checkpoint, no model hub needed."""

from __future__ import annotations

from pathlib import Path

import click
from tqdm import tqdm

from qcompile.errors import QCompileError
from qcompile.recipe.schema import DEFAULT_RECIPE, load_recipe
from qcompile.synth.checkpoint import DEFAULT_MAX_SHARD_BYTES, plan_checkpoint, preflight, write_checkpoint
from qcompile.synth.presets import UnknownPresetError, get_preset, preset_names
from qcompile.units import human_bytes, human_count


def preset_table() -> list[tuple[str, str, str, str]]:
    """(name, source, parameters, size on disk) for every preset, for --help."""
    rows = []
    for name in preset_names():
        plan = plan_checkpoint(name)
        kind = "MoE" if plan.spec.is_moe else "dense"
        source = get_preset(name).source
        source = f"{source}, {kind}" if source != "test" else f"test, {kind}"
        rows.append((name, source, human_count(plan.parameters), human_bytes(plan.weight_bytes)))
    return rows


class _SynthCommand(click.Command):
    """Lists the presets after the options; the table is computed only when help is shown."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Presets (parameters, size on disk in bf16)"):
            rows = [(name, f"{params:>8}  {size:>9}  {source}") for name, source, params, size in preset_table()]
            formatter.write_dl(rows)


@click.command("synth", cls=_SynthCommand)
@click.argument("preset")
@click.option(
    "-o", "--output", "output", required=True, type=click.Path(path_type=Path), help="Checkpoint directory to create."
)
@click.option(
    "--seed", default=0, show_default=True, type=int, help="Seed of the random weights (same seed: same bytes)."
)
@click.option(
    "--max-shard-mb",
    default=DEFAULT_MAX_SHARD_BYTES / 1e6,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Largest safetensors shard, in MB (10^6 bytes); one file when everything fits.",
)
@click.option("--force", is_flag=True, help="Replace an existing output directory (only once the new one is complete).")
@click.option(
    "--artifact",
    is_flag=True,
    help="Write a SYNTHETIC artifact instead: the compiled graph and manifest of PRESET with sparse weight "
    "files; qruntime makes random weights on the GPU at load (for benchmarks at full model scale).",
)
@click.option("-r", "--recipe", "recipe_name", default=None, help="With --artifact: the recipe (default ptpc-fp8).")
@click.option("--tp", type=int, default=None, help="With --artifact: tensor-parallel ranks to shard for.")
def command(
    preset: str,
    output: Path,
    seed: int,
    max_shard_mb: float,
    force: bool,
    artifact: bool,
    recipe_name: str | None,
    tp: int | None,
) -> None:
    """Write a random-weight Qwen3 or Qwen3-VL checkpoint of PRESET, with a locally trained tokenizer.

    The directory is a Hugging Face checkpoint (config.json, safetensors shards, tokenizer files; a
    Qwen3-VL preset adds preprocessor_config.json and its vision tower under model.visual.) that
    transformers and `qcompile compile` load like a published one. Weights are bf16 random
    values (normal(0, 0.02); norms around 1) fixed by --seed; nothing is downloaded.

    With --artifact it is instead a synthetic artifact, compiled from a sparse checkpoint of PRESET
    (no disk for either): `qruntime.load` fills its weights with random values on the device, so a
    qwen3-235b-a22b can be run and timed without its 470 GB. It is labelled synthetic everywhere and
    cannot be verified, published or exported.
    """
    try:
        get_preset(preset)
    except UnknownPresetError as exc:
        raise click.BadParameter(str(exc), param_hint="PRESET") from None
    if not artifact and (recipe_name is not None or tp is not None):
        raise click.UsageError("--recipe and --tp apply to --artifact only")
    if artifact:
        _synthetic_artifact(preset, output, recipe_name or DEFAULT_RECIPE, tp, force)
        return
    max_shard_bytes = max(1, int(max_shard_mb * 1e6))
    plan = plan_checkpoint(preset, max_shard_bytes)
    preflight(plan, output, force)  # refuse before the progress bar appears
    bar = tqdm(
        total=plan.weight_bytes, unit="B", unit_scale=True, unit_divisor=1000, desc=preset, leave=False, disable=None
    )
    with bar:
        result = write_checkpoint(
            preset, output, seed=seed, max_shard_bytes=max_shard_bytes, progress=bar.update, force=force
        )
    files = "1 file" if result.shards == 1 else f"{result.shards} shards"
    click.echo(
        f"wrote {preset}: {human_count(result.parameters)} parameters, {human_bytes(result.weight_bytes)} in {files} "
        f"(seed {seed}) at {result.path}"
    )


def _synthetic_artifact(preset: str, output: Path, recipe_name: str, tp: int | None, force: bool) -> None:
    from qcompile.synth.artifact import write_synthetic_artifact

    try:
        manifest = write_synthetic_artifact(preset, output, load_recipe(recipe_name), tp=tp, force=force)
    except QCompileError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"wrote a SYNTHETIC artifact of {preset} ({manifest['recipe']['name']}, tp={manifest['tp']}) at {output}: "
        "random weights are made on the device at load"
    )
