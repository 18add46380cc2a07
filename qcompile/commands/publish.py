"""`qcompile publish ART --to DIR | hf://ORG/NAME`: the artifact, its model card and the runtime wheel."""

from __future__ import annotations

from pathlib import Path

import click

from qcompile.units import human_bytes


@click.command("publish")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--to", "target", required=True, metavar="DIR|hf://ORG/NAME", help="A folder, or a Hugging Face hub repository."
)
@click.option(
    "--eval",
    "evals",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="JSON of `qcompile eval --json` or `qcompile eval-recipes --json`, shown as a table in the card. Repeatable.",
)
@click.option(
    "--bench",
    "benches",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="JSON of `qcompile bench --json`, shown as a table in the card. Repeatable.",
)
@click.option(
    "--base-model",
    default=None,
    metavar="ORG/NAME",
    help="The source checkpoint's hub name for the card [default: from the source path the manifest records].",
)
@click.option(
    "--dry-run", is_flag=True, help="List what would be written or uploaded (path, bytes, sha256); write nothing."
)
@click.option(
    "--force", is_flag=True, help="Replace a target that holds anything other than an earlier publish of ART."
)
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def command(artifact, target, evals, benches, base_model, dry_run, force, no_progress) -> None:
    """Publish ARTIFACT with a model card and the runtime wheel, to a folder or the hub.

    Every file is first checked against the manifest's sha256 (an artifact that does not verify is
    refused). The target gets the artifact's files unchanged (hard links when on the same file
    system), README.md (the model card: hub front matter with base_model and the source's license,
    what is inside, the --eval / --bench tables, how to run it with qruntime and vLLM, how to
    reproduce it, every file's sha256) and runtime/qcompile_runtime-*.whl, built now from the
    runtime's source; the published manifest.json lists them too. Reports found in
    ARTIFACT/reports/*.json are shown and copied too. A folder appears only when complete; one that
    exists is replaced only when it is an earlier publish of the same artifact, or with --force. The
    same inputs give the same bytes.

        qcompile publish ./qwen3-8b-fp8 --to ./qwen3-8b-fp8-pub --eval eval.json --bench bench.json
    """
    from qcompile.publish.publication import publish

    result = publish(
        artifact,
        target,
        evals=evals,
        benches=benches,
        base_model=base_model,
        dry_run=dry_run,
        force=force,
        progress=not no_progress,
    )
    if dry_run:
        action = "would replace" if result.replaced else "would write"
        click.echo(f"dry run: {action} {result.target}:")
        width = max(len(e.path) for e in result.entries)
        for e in result.entries:
            click.echo(f"  {e.path:<{width}}  {e.bytes:>14,}  {e.sha256[:12]}")
        click.echo(f"{len(result.entries)} files, {human_bytes(result.total_bytes)}; nothing written")
        return
    click.echo(
        f"published {artifact} to {result.target}: {len(result.entries)} files, {human_bytes(result.total_bytes)}"
        f"{' (replaced the earlier publish)' if result.replaced else ''}; runtime {result.wheel} ({result.wheel_origin})"
    )
