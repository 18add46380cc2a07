"""Artifacts on the Hugging Face Hub, by name: `pull("hf://org/name[@revision]")` downloads one and
checks every file against the sha256 in its manifest before handing back its directory.

huggingface_hub (installed with tokenizers) does the transport and finds the endpoint (HF_ENDPOINT),
the cache (HF_HOME) and the token (HF_TOKEN, `hf auth login`) as it always does. It is imported only
when a pull runs: importing this module stays cheap.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from qruntime.artifact import MANIFEST, ArtifactFormatError, read_manifest, verify_files

SCHEME = "hf://"
DEFAULT_REVISION = "main"
# Files the hub keeps in every repo (LFS rules); never part of an artifact, never pulled or deleted.
HUB_METADATA = frozenset({".gitattributes"})
_LOCAL_DIR_METADATA = ".cache"  # huggingface_hub's bookkeeping inside a local_dir download

# The hub's repo-name rules: letters, digits, "-", "_", "."; no "--" or ".."; not starting or ending in "-" or ".".
_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")
_REVISION = re.compile(r"[A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)*")
URL_FORM = "hf://<namespace>/<name>[@<revision>]"


class HubError(ArtifactFormatError):
    """An hf:// name is malformed, the hub cannot serve it, or what it served does not verify."""


@dataclass(frozen=True)
class HubRef:
    """A model repo on the Hugging Face Hub at a branch, tag or commit."""

    repo_id: str  # "namespace/name"
    revision: str = DEFAULT_REVISION

    def __str__(self) -> str:
        suffix = "" if self.revision == DEFAULT_REVISION else f"@{self.revision}"
        return f"{SCHEME}{self.repo_id}{suffix}"


def is_hub_url(path: object) -> bool:
    """Whether `path` names an artifact on the hub (a str starting with hf://) rather than a directory."""
    return isinstance(path, str) and path.startswith(SCHEME)


def parse_url(url: str, revision: str | None = None) -> HubRef:
    """`hf://namespace/name[@revision]` -> HubRef. `revision` (a branch, tag or commit) may be given here
    instead of in the URL; given in both places it must agree. Raises HubError naming what is wrong."""
    if not is_hub_url(url):
        raise HubError(f"{url!r} is not a hub artifact name; expected {URL_FORM}")
    body = url[len(SCHEME) :]
    repo_id, at, url_revision = body.partition("@")
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts):
        raise HubError(f"{url!r}: expected {URL_FORM} (a namespace, a slash, a name)")
    for part in parts:
        if not _NAME.fullmatch(part) or "--" in part or ".." in part:
            raise HubError(
                f"{url!r}: {part!r} is not a valid hub name (letters, digits, '-', '_', '.'; at most 96; "
                "no '--' or '..'; not starting or ending with '-' or '.')"
            )
    if at and not url_revision:
        raise HubError(f"{url!r}: empty revision after '@'")
    for candidate in (url_revision, revision):
        if candidate and (not _REVISION.fullmatch(candidate) or ".." in candidate):
            raise HubError(f"{url!r}: {candidate!r} is not a valid revision (a branch, tag or commit)")
    if url_revision and revision and url_revision != revision:
        raise HubError(f"{url!r}: revision {revision!r} given as well; they disagree")
    return HubRef(repo_id, url_revision or revision or DEFAULT_REVISION)


def pull(url: str, dest: str | Path | None = None, *, revision: str | None = None, progress: bool = True) -> Path:
    """Download the artifact `url` (hf://namespace/name[@revision]) and verify every file.

    With `dest`, the artifact appears there only once it has verified: it is downloaded into a
    temporary directory beside `dest` and renamed into place (`dest` must not exist, or be an empty
    directory). Without it, the artifact lands in the Hugging Face cache (HF_HOME) and its snapshot
    directory is returned. A file that does not match manifest.json is a HubError naming it; nothing is
    left at `dest`, and the bad files are dropped from the cache so that the next pull fetches them
    again. `progress`: huggingface_hub's download bars on stderr.
    """
    ref = parse_url(url, revision)
    hf = _huggingface_hub()
    if dest is None:
        root = Path(_download(hf, ref, None, progress))
        _verify(ref, root, evict=True)
        return root

    dest = Path(dest).absolute()
    if dest.is_symlink() or dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise HubError(f"{dest}: already exists; pull into a new (or empty) directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".pull", dir=dest.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp makes it private; the artifact is an ordinary directory
        _download(hf, ref, staging, progress)
        shutil.rmtree(staging / _LOCAL_DIR_METADATA, ignore_errors=True)
        _verify(ref, staging, evict=False)
        if dest.is_dir():
            dest.rmdir()  # empty (checked above); fails loudly if someone filled it meanwhile
        staging.rename(dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return dest


# --- internals ------------------------------------------------------------------------------------
def _huggingface_hub() -> ModuleType:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.utils
    except ImportError as exc:  # tokenizers brings it; a stripped environment may not have it
        raise HubError(f"hf:// artifacts need huggingface_hub: pip install huggingface_hub ({exc})") from exc
    return huggingface_hub


def _quiet_tqdm(hf: ModuleType) -> type:
    class Quiet(hf.utils.tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet


def _download(hf: ModuleType, ref: HubRef, local_dir: Path | None, progress: bool) -> str:
    errors = hf.errors
    try:
        return hf.snapshot_download(
            ref.repo_id,
            revision=ref.revision,
            local_dir=local_dir,
            ignore_patterns=sorted(HUB_METADATA),
            tqdm_class=None if progress else _quiet_tqdm(hf),
        )
    except errors.RevisionNotFoundError as exc:
        raise HubError(f"{ref}: the repo has no branch, tag or commit {ref.revision!r}") from exc
    except errors.RepositoryNotFoundError as exc:
        raise HubError(
            f"{ref}: no such model repo on {hf.constants.ENDPOINT}, or it is private and no token with access "
            "to it was found (log in with `hf auth login` or set HF_TOKEN)"
        ) from exc
    except _transport_errors(hf) as exc:
        reason = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
        raise HubError(f"{ref}: download failed: {reason}") from exc


def _transport_errors(hf: ModuleType) -> tuple[type[BaseException], ...]:
    """What a failed download raises: the hub's HTTP errors, OSError (a missing cached snapshot
    included) and the HTTP client's own (httpx in huggingface_hub 1.x)."""
    found: list[type[BaseException]] = [hf.errors.HfHubHTTPError, OSError]
    try:
        import httpx
    except ImportError:
        pass
    else:
        found.append(httpx.HTTPError)
    return tuple(found)


def _verify(ref: HubRef, root: Path, *, evict: bool) -> None:
    """Every file the manifest lists must match its size and sha256 (qruntime.artifact's check)."""
    if not (root / MANIFEST).is_file():
        raise HubError(f"{ref}: the repo holds no {MANIFEST}; it is not a qcompile artifact")
    try:
        manifest = read_manifest(root)
    except ArtifactFormatError as exc:
        raise HubError(f"{ref}: {exc}") from exc
    problems = verify_files(root, manifest)
    if problems:
        if evict:
            _evict(root, [p.path for p in problems])
        raise HubError(
            f"{ref}: the downloaded artifact does not match its manifest:\n  " + "\n  ".join(map(str, problems))
        )
    listed = set(manifest["files"]) | {MANIFEST}
    unlisted = sorted(
        rel
        for path in root.rglob("*")
        if path.is_file() and (rel := path.relative_to(root).as_posix()) not in listed
        if not rel.startswith(f"{_LOCAL_DIR_METADATA}/")
    )
    if unlisted:
        warnings.warn(f"{ref}: not listed in its manifest (not verified): {', '.join(unlisted)}", stacklevel=3)


def _evict(root: Path, rels: list[str]) -> None:
    """Drop bad files from a cache snapshot (the link and the blob it points to)."""
    for rel in rels:
        path = root / rel
        if path.is_symlink():
            path.resolve().unlink(missing_ok=True)
        path.unlink(missing_ok=True)
