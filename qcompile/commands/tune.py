"""`qcompile tune ART`: time the runtime's GEMM backends on this GPU, store the winners in the artifact."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("tune")
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--buckets",
    default=None,
    help="Comma-separated token counts to tune for [default: 1,2,4,...,8192].",
)
@click.option(
    "--kernel-builds/--no-kernel-builds",
    default=True,
    show_default=True,
    help="Then record the kernels the tuned engine launches, for loads on this GPU model to build "
    "them in parallel while reading the weights (kernel_builds/<GPU model>.json).",
)
def command(artifact: Path, buckets: str | None, kernel_builds: bool) -> None:
    """Tune ARTIFACT's kernels for the GPU of this machine.

    For each FP8 weight shape and token-count bucket, times the Triton FP8 GEMM over its candidate
    configs and cuBLASLt (torch._scaled_mm), checks the winner against the reference math, and writes
    kernels/<GPU model>.json into the artifact (its manifest entry updated). The runtime loads that
    file on a GPU of the same model and never autotunes at load.

    Then, in a fresh process, loads the tuned artifact and records every Triton kernel its engine
    compiles (kernel_builds/<GPU model>.json): a later load on this GPU model builds them all in
    parallel while it reads the weights, instead of one by one at their first launch. The list
    names kernels of qruntime and their block sizes, never code.
    """
    from qcompile.tune.artifact import TOKEN_BUCKETS, tune_artifact

    chosen = TOKEN_BUCKETS if buckets is None else tuple(int(b) for b in buckets.split(","))
    path = tune_artifact(
        artifact, chosen, progress=lambda key: click.echo(f"tuned {key}", err=True), record_builds=kernel_builds
    )
    click.echo(f"wrote {path}")
