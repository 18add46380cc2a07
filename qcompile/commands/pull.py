"""`qcompile pull hf://org/name -o DIR`: download an artifact from the Hugging Face Hub, verified."""

from __future__ import annotations

from pathlib import Path

import click
from qruntime.commands.common import RunError
from qruntime.commands.pull import PULL_OUTPUT_HELP, PULL_REVISION_HELP
from qruntime.commands.pull import pull as pull_artifact

from qcompile.errors import HubError


@click.command("pull")
@click.argument("url", metavar="hf://ORG/NAME[@REVISION]")
@click.option("-o", "--output", type=click.Path(path_type=Path), metavar="DIR", help=PULL_OUTPUT_HELP)
@click.option("--revision", metavar="REV", help=PULL_REVISION_HELP)
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
def command(url: str, output: Path | None, revision: str | None, quiet: bool) -> None:
    """Download an artifact from the Hugging Face Hub and check every file against the sha256 in
    its manifest (the runtime's `qruntime pull`).

    With -o DIR the artifact appears at DIR only once it has verified (DIR must not exist, or be
    empty); without it, it lands in the Hugging Face cache and its path is printed. A file that does
    not match the manifest is named, and nothing is left behind. The token is huggingface_hub's
    (HF_TOKEN or `hf auth login`), needed for private repos only.
    """
    try:
        click.echo(pull_artifact(url, None if output is None else str(output), revision, quiet))
    except RunError as exc:
        raise HubError(str(exc)) from exc
