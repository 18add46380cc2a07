"""`qcompile compile CKPT -o ART`: the main job."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click
from qruntime.target import DEFAULT_TARGET, TARGETS, get_target

from qcompile.errors import QCompileError
from qcompile.io.atomic import check_target
from qcompile.recipe.schema import DEFAULT_RECIPE, load_recipe
from qcompile.source.directory import check_checkpoint_dir
from qcompile.units import human_bytes


def _draft_row(draft, num_layers: int) -> str:
    if draft is None:
        return "-"
    row = f"layer-skip: layers {', '.join(map(str, draft.layers))} skipped"
    if draft.agreement is None:
        return row
    from qcompile.compile.draft_layers import modelled_speedup  # torch: imported when a compile runs

    speedup = modelled_speedup(draft.agreement, (num_layers - len(draft.layers)) / num_layers)
    row += f", top-1 agreement {draft.agreement:.1%} on the calibration text, modelled speed-up {speedup:.2f}x"
    if speedup < 1:
        row += " (below 1: on this model no layer-skip draft the search tried would decode faster than the model alone)"
    return row


def _summary_rows(prepared, output: Path, workers: int) -> list[tuple[str, str]]:
    spec, recipe, plan = prepared.checkpoint.spec, prepared.recipe, prepared.plan
    model = f"{spec.architecture}, {spec.num_hidden_layers} layers, hidden {spec.hidden_size}, "
    model += f"heads {spec.num_attention_heads}/{spec.num_key_value_heads}"
    if spec.moe is not None:
        model += f", {spec.moe.num_experts} experts top-{spec.moe.num_experts_per_tok}"
    kv = recipe.kv_cache
    stored = prepared.checkpoint.quantization
    source = f"{spec.dtype} weights, quantized by the recipe"
    if stored is not None:
        count = len(prepared.checkpoint.stored)
        source = f"pre-quantized, {stored.describe()}; {count} stored linears copied as they are, not re-quantized"
    return [
        ("checkpoint", str(prepared.checkpoint.path)),
        ("input", source),
        ("model", model),
        ("recipe", recipe.name),
        ("scheme", recipe.quantization.scheme),
        (
            "ignore",
            (", ".join(recipe.quantization.ignore) or "-") + (" (as the checkpoint stores them)" if stored else ""),
        ),
        ("passes", ", ".join(prepared.graph.applied_passes) or "(none: unfused)"),
        ("kv cache", f"{kv.dtype}, layout {kv.layout}, block {kv.block_size}"),
        ("tp", _tp_row(prepared)),
        ("target", f"{recipe.target} ({get_target(recipe.target).fp8} weights)"),
        ("tokenizer", "copied" if prepared.tokenizer else "none (--no-tokenizer): token-id prompts only"),
        ("draft", _draft_row(prepared.speculative, spec.num_hidden_layers)),
        ("tensors", f"{len(plan.jobs)} weights from {len(prepared.checkpoint.tensors)} source tensors"),
        (
            "bytes",
            f"{human_bytes(plan.source_bytes)} read -> {human_bytes(plan.output_bytes)} in {len(plan.shards)} file(s)",
        ),
        ("output", str(output)),
        ("workers", str(workers)),
    ]


def _tp_row(prepared) -> str:
    tp = prepared.recipe.tp
    if tp == 1:
        return "1"
    from qcompile.compile.sharding import local_heads

    spec = prepared.checkpoint.spec
    heads, kv_heads = local_heads(spec, tp)
    replicated = " (replicated)" if spec.num_key_value_heads < tp else ""
    return f"{tp}: per rank {heads} query / {kv_heads} KV head(s){replicated}, weights/rank0 … rank{tp - 1}"


@click.command("compile")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Artifact directory to create.")
@click.option(
    "-r",
    "--recipe",
    default=None,
    help=f"A shipped recipe name or a YAML file (ours, or an llm-compressor recipe with a "
    f"QuantizationModifier using FP8_DYNAMIC, FP8_BLOCK or W4A16, or an AWQModifier with W4A16: w4a16-awq, "
    f"which needs --calib) [default: {DEFAULT_RECIPE}; for a pre-quantized "
    "checkpoint the recipe of its stored scheme].",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a recipe key, e.g. --set kv_cache.layout=hnd --set passes=fuse_qkv_proj,fuse_gate_up_proj "
    "--set 'quantization.ignore=[lm_head]'. Repeatable.",
)
@click.option(
    "--tp",
    type=int,
    default=None,
    metavar="N",
    help="Pre-shard the weights for N-way tensor parallelism (a power of two; overrides the recipe's tp): "
    "weights/rank{r}/ and graph.rank{r}.onnx per rank.",
)
@click.option(
    "--target",
    type=click.Choice(list(TARGETS)),
    default=None,
    help=f"The GPU family the artifact is made for (overrides the recipe's target) [default: {DEFAULT_TARGET}]. "
    "amd-gfx942 (MI300X / MI308X / MI325X) stores FP8 weights as float8_e4m3fnuz, the scales doubled so "
    "that every weight dequantizes to the nvidia-sm90 artifact's value; loading checks the GPU against it.",
)
@click.option("--force", is_flag=True, help="Replace an existing output directory (only once the new one is complete).")
@click.option("-j", "--workers", type=click.IntRange(1, 64), default=None, help="Worker threads [default: all cores].")
@click.option("--dry-run", is_flag=True, help="Validate the checkpoint and recipe and print the plan; write nothing.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars or summary table.")
@click.option("--tune", is_flag=True, help="Then tune the kernels on this machine's GPU (as `qcompile tune`).")
@click.option(
    "--calib",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Calibration text for a recipe with a calibrated fp8 KV cache (ptpc-fp8-kv8): per-layer K/V "
    "scales, or with AWQ (w4a16-awq): per-channel weight scales, from the source model run on it, one "
    "layer in memory at a time.",
)
@click.option(
    "--draft-layers",
    "draft_layers",
    default=None,
    metavar="auto|I,J,...",
    help="Record a self-speculative draft in the artifact: the decoder layers it skips (qruntime's "
    "--speculative layer-skip drafts with the model less them). 'auto' searches on --calib FILE, streaming "
    "the source one layer at a time: the least influential layers, as many as give the best modelled "
    "speed-up from the draft's agreement with the model; or give the indexes.",
)
@click.option(
    "--no-tokenizer",
    "no_tokenizer",
    is_flag=True,
    help="Compile a checkpoint that has no tokenizer.json: the artifact holds no tokenizer files (even if the "
    'checkpoint has some) and its manifest says "tokenizer": false; it takes token-id prompts only. Without '
    "this flag such a checkpoint is refused before any work.",
)
def command(
    checkpoint,
    output,
    recipe,
    overrides,
    tp,
    target,
    force,
    workers,
    dry_run,
    quiet,
    tune,
    calib,
    draft_layers,
    no_tokenizer,
):
    """Compile a Hugging Face Qwen3 checkpoint into an artifact.

    Streams CHECKPOINT (a directory with config.json and safetensors shards) tensor by tensor —
    never holding the model in memory — into OUTPUT: PTPC-FP8 weights pre-fused for the kernels,
    the KV-cache layout, graph.onnx and manifest.json with the sha256 of every file. The artifact
    appears at OUTPUT only when complete; a failure or Ctrl-C leaves nothing behind.

    Shipped recipes (recipes/*.yaml): ptpc-fp8 (default), ptpc-fp8-lmhead, block-fp8, tensor-fp8
    (vLLM's per-tensor fp8), w4a16 (int4 weights in groups of 128, round to nearest), w4a16-awq (the
    same format with AWQ scales searched on --calib FILE), bf16, ptpc-fp8-unfused, ptpc-fp8-kv8 (fp8
    KV cache calibrated on --calib FILE). Example:

        qcompile compile ./Qwen3-8B -o ./qwen3-8b-fp8 --set kv_cache.layout=hnd

    With --tp N the artifact is pre-sharded for N GPUs: each rank's slice of every weight in
    weights/rank{r}/ and its own graph, graph.rank{r}.onnx (docs/ARTIFACT.md).

    A pre-quantized checkpoint (config.json's quantization_config: llm-compressor's compressed-tensors
    FP8 per channel, per tensor or in 128x128 blocks, or W4A16 pack-quantized) is transcoded: its
    quantized weights and scales are copied as they are, never re-quantized, into the artifact of the
    matching recipe (ptpc-fp8, tensor-fp8, block-fp8, w4a16), taken when --recipe is not given; a
    recipe of another scheme is refused. Linears it keeps unquantized stay so.
    """
    # the paths the user typed first: what follows imports torch, seconds before any error it could report
    check_checkpoint_dir(checkpoint)
    check_target(output.absolute(), force)
    if tune and not dry_run:
        import torch

        if not torch.cuda.is_available():
            raise QCompileError("--tune needs a CUDA GPU on this machine (run `qcompile tune ART` on one later)")
    from qcompile.compile.pipeline import compile_checkpoint, prepare
    from qcompile.recipe.prequantized import default_recipe, refuse_ignore_override

    workers = workers or max(1, len(os.sched_getaffinity(0)))
    if tp is not None:
        overrides = (*overrides, f"tp={tp}")  # last: the flag wins over the recipe and --set
    if target is not None:
        overrides = (*overrides, f"target={target}")
    refuse_ignore_override(overrides, checkpoint)
    resolved = load_recipe(recipe or default_recipe(checkpoint), overrides)
    prepared = prepare(
        checkpoint,
        resolved,
        calib,
        calibrate=not dry_run,
        progress=not quiet,
        tokenizer=not no_tokenizer,
        draft_layers=draft_layers,
    )
    if not quiet or dry_run:
        rows = _summary_rows(prepared, output, workers)
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            click.echo(f"  {key:<{width}}  {value}")
    if dry_run:
        click.echo("dry run: checkpoint and recipe are valid; nothing written")
        return
    start = time.perf_counter()
    manifest = compile_checkpoint(prepared, output, force=force, workers=workers, progress=not quiet)
    total = sum(f["bytes"] for f in manifest["files"].values())
    click.echo(
        f"wrote {output} ({human_bytes(total)}, {len(manifest['files'])} files) in {time.perf_counter() - start:.1f} s"
    )
    if tune:
        from qcompile.tune.artifact import tune_artifact

        click.echo(f"tuned kernels: {tune_artifact(output)}")
