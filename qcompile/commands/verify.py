"""`qcompile verify ART`: every file against its sha256 in the manifest; any link in the artifact is an error."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from qruntime.artifact import ArtifactFormatError, FileProblem, find_links, read_manifest, verify_files
from qruntime.target import DEFAULT_TARGET
from tqdm import tqdm

from qcompile.errors import ArtifactError


@click.command("verify")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def command(artifact: Path, quiet: bool) -> None:
    """Check every file of ARTIFACT against the size and sha256 recorded in manifest.json.

    Exits 0 when all match; otherwise exits 1 naming the first bad file (and lists the others). A
    symbolic link anywhere in ARTIFACT is an error too: an artifact's files are its own.
    """
    try:
        manifest = read_manifest(artifact)
    except ArtifactFormatError as exc:
        raise ArtifactError(str(exc)) from exc
    with tqdm(
        total=len(manifest["files"]), desc="verify", unit="file", disable=True if quiet else None, leave=False
    ) as bar:
        problems = verify_files(artifact, manifest, progress=lambda _: bar.update())
    links = find_links(artifact)
    problems += [FileProblem(rel, "is a symbolic link (refused)") for rel in links if rel not in manifest["files"]]
    listed = set(manifest["files"]) | {"manifest.json"}
    extra = sorted(
        p.relative_to(artifact).as_posix() for p in artifact.rglob("*") if p.is_file() and not p.is_symlink()
    )
    extra = [p for p in extra if p not in listed and not any(p.startswith(f"{link}/") for link in links)]
    for path in extra:
        click.echo(f"note: {path} is not listed in the manifest (not verified)", err=True)
    if problems:
        click.echo(f"error: {problems[0]}", err=True)
        for problem in problems[1:]:
            click.echo(f"       {problem}", err=True)
        sys.exit(1)
    target = manifest.get("target", DEFAULT_TARGET)
    click.echo(f"ok: {len(manifest['files'])} files verified in {artifact} (target {target})")
