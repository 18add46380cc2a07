"""`qruntime pull hf://org/name -o DIR`: download an artifact from the Hugging Face Hub, verified."""

from __future__ import annotations

from qruntime.commands.common import RunError

PULL_OUTPUT_HELP = "Directory to create (it must not exist, or be empty); default: the Hugging Face cache (HF_HOME)."
PULL_REVISION_HELP = "Branch, tag or commit to pull (default: the @revision of URL, else main)."


def pull(url: str, output: str | None = None, revision: str | None = None, quiet: bool = False) -> str:
    """Download and verify the artifact `url` (qruntime.hub.pull); returns the line to print.
    Raises RunError for a malformed name, a hub error or a file that does not verify."""
    from qruntime.artifact import read_manifest
    from qruntime.hub import HubError
    from qruntime.hub import pull as pull_artifact

    try:
        path = pull_artifact(url, output, revision=revision, progress=not quiet)
    except HubError as exc:
        raise RunError.of(exc) from None
    return f"ok: {len(read_manifest(path)['files'])} files verified in {path}"
