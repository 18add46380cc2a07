"""`qcompile export ART --format compressed-tensors -o DIR`: a checkpoint other engines load."""

from __future__ import annotations

from pathlib import Path

import click

from qcompile.publish.export import EXPORTERS
from qcompile.units import human_bytes, parse_bytes


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.command("export")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(list(EXPORTERS)),
    default="compressed-tensors",
    show_default=True,
    help="The checkpoint format to write.",
)
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Directory to create.")
@click.option(
    "--max-shard-size",
    "max_shard_bytes",
    default="5GB",
    show_default=True,
    callback=_size,
    help="Largest safetensors file (5GB, 500MB, 2GiB or bytes); more than one file comes with "
    "model.safetensors.index.json.",
)
@click.option("--force", is_flag=True, help="Replace an existing output directory (only once the new one is complete).")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def command(artifact: Path, fmt: str, output: Path, max_shard_bytes: int, force: bool, no_progress: bool) -> None:
    """Export ARTIFACT as a Hugging Face checkpoint in compressed-tensors format, at OUTPUT.

    compressed-tensors is the format llm-compressor writes; transformers (with the compressed-tensors
    package installed), vLLM and SGLang load it. The weights get the source checkpoint's names back
    (fused and stacked tensors split losslessly): FP8 `<linear>.weight` with its `weight_scale`, the
    rest as it was, byte-identical to what llm-compressor writes for the same checkpoint and scheme;
    an fp8 KV cache adds each layer's `self_attn.k_scale` / `v_scale`. config.json is the source's with
    a compressed-tensors `quantization_config` (none for bf16); tokenizer, generation config and
    license files come along, and a README.md naming the source fingerprint and recipe.

    A Qwen3-VL artifact exports as transformers' Qwen3VL(Moe)ForConditionalGeneration checkpoint: text
    tensors under model.language_model., the vision tower (never quantized, in the ignore list) as it
    was, MoE experts stacked again, preprocessor_config.json from the artifact; an FP8 MoE's experts are
    refused (transformers 5.17 loads no quantized stacked experts for Qwen3-VL-MoE).

    Every file of ARTIFACT is first checked against its manifest's sha256 (one that does not verify is
    refused). Tensors stream one at a time into safetensors shards of at most --max-shard-size; OUTPUT
    appears only when complete, and a failure or Ctrl-C leaves nothing behind. tp > 1 artifacts are
    not supported yet.

    \b
        qcompile export ./qwen3-8b-fp8 -o ./qwen3-8b-fp8-ct
        vllm serve ./qwen3-8b-fp8-ct
    """
    files = EXPORTERS[fmt](artifact, output, max_shard_bytes=max_shard_bytes, force=force, progress=not no_progress)
    total = sum((output / name).stat().st_size for name in files)
    click.echo(f"wrote {output} ({fmt}, {human_bytes(total)}, {len(files)} files)")
