"""Artifact format 1: reading manifest.json, confining every path it names, verifying file hashes.

Shared by the runtime (`load(..., verify=True)`) and the compiler (`qcompile verify`, inspect,
export, publish), so both sides check an artifact the same way.

Confinement. Every file read because an artifact says so goes through `artifact_path(root, rel)`:
`rel` is relative and normalised (no `..`, no `.`, no backslash), and no component of it below
`root` is a symbolic link, so it resolves inside the artifact; the file is a regular file. Readers
that read at load pass `listed`, the manifest's `files`: a file the manifest does not vouch for is
refused too. Hard links are allowed (publish itself hard-links the artifact's files into the
published tree): a hard link can only name a file of the same file system that its maker could
already read, and the manifest's sha256 vouches for its bytes. The one exception to "no links" is a
Hugging Face cache snapshot (what `qruntime.hub.pull` returns without a destination): its files are
links to `../../blobs/<hash>` of the same `models--*` cache folder, and those are followed when the
target is a regular file directly in that folder's blobs/.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import stat
from collections.abc import Container, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from qruntime import bounded_json
from qruntime.manifest_schema import SchemaError, check_manifest

FORMAT_VERSION = "1.0"
MANIFEST = "manifest.json"
CHECKPOINT_INDEX = "model.safetensors.index.json"  # a sharded Hugging Face checkpoint's index of tensors
MAX_MANIFEST_BYTES = 256 << 20  # a 235B-parameter MoE's manifest is a few MB
# what a compiled artifact's manifest holds beyond REQUIRED, and what inspect, export and publish read
COMPILED_FIELDS = (
    "toolchain",
    "source.path",
    "source.fingerprint",
    "spec.architecture",
    "spec.dtype",
    "spec.vocab_size",
    "spec.hidden_size",
    "spec.num_hidden_layers",
    "spec.num_attention_heads",
    "spec.num_key_value_heads",
    "spec.head_dim",
    "spec.max_position_embeddings",
    "spec.tie_word_embeddings",
    "recipe.name",
    "recipe.quantization.scheme",
    "recipe.quantization.ignore",
    "passes",
    "kv_cache",
    "graph",
    "tensors",
)
LINK_REFUSED = "is a symbolic link; an artifact's files must be its own (links are refused)"


class ArtifactFormatError(Exception):
    """The artifact is missing, malformed, of an unknown format version, or fails verification."""


@dataclass(frozen=True)
class FileProblem:
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def read_manifest(root: str | Path) -> dict[str, Any]:
    """Read ART/manifest.json and check it against its schema (qruntime.manifest_schema): a junk
    manifest is an ArtifactFormatError naming the field; every path in `files` is a normalised
    relative path."""
    check_artifact_dir(root)
    path = artifact_path(root, MANIFEST)
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ArtifactFormatError(
            f"{path}: {path.stat().st_size} bytes, more than a manifest holds ({MAX_MANIFEST_BYTES})"
        )
    try:
        manifest = bounded_json.loads(path.read_bytes(), what=str(path))
    except bounded_json.JSONLimitError as exc:
        raise ArtifactFormatError(str(exc)) from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ArtifactFormatError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(manifest, dict):
        raise ArtifactFormatError(f"{path}: expected a JSON object")
    version = manifest.get("format_version")
    if not isinstance(version, str) or version.split(".")[0] != FORMAT_VERSION.split(".")[0]:
        shown = version if isinstance(version, str) and len(version) <= 32 else type(version).__name__
        raise ArtifactFormatError(
            f"{path}: artifact format_version {shown!r} is not supported by this runtime, "
            f"which reads format {FORMAT_VERSION}"
        )
    try:
        check_manifest(manifest)
    except SchemaError as exc:
        raise ArtifactFormatError(f"{path}: {exc}") from None
    for rel in manifest["files"]:
        check_relative_path(rel)
    return manifest


def read_manifest_or_none(path: str | Path) -> dict[str, Any] | None:
    """read_manifest of a local artifact, read once for a load's early work (the read-ahead, the early
    kernel build) and the load itself; None for a hub URL or whatever read_manifest refuses (the load
    reads it again and says what is wrong)."""
    if str(path).startswith("hf://"):
        return None
    try:
        return read_manifest(path)
    except (ArtifactFormatError, OSError, ValueError):
        return None


def check_artifact_dir(root: str | Path) -> None:
    """What read_manifest checks first, cheaply (no file is read): `root` is a directory holding a
    manifest.json. Raises ArtifactFormatError saying what `root` is instead: missing, not a
    directory, or a Hugging Face checkpoint (which is compiled into an artifact, not run). The CLIs
    call it before importing torch, so a mistyped path is reported at once."""
    root = Path(root)
    if not os.path.exists(root):  # os.path's checks answer False where pathlib's raise (EACCES on a parent)
        raise ArtifactFormatError(f"{root}: artifact directory not found")
    if not os.path.isdir(root):
        raise ArtifactFormatError(f"{root}: not a directory; an artifact is the directory `qcompile compile` writes")
    if os.path.lexists(root / MANIFEST):
        return
    if _is_hf_checkpoint(root):
        raise ArtifactFormatError(
            f"{root}: a Hugging Face checkpoint, not a compiled artifact (it has config.json and safetensors "
            f"weights but no {MANIFEST}); compile it first: qcompile compile {shlex.quote(str(root))} -o ART"
        )
    raise ArtifactFormatError(f"{root / MANIFEST}: not found; is {root} a qcompile artifact?")


def _is_hf_checkpoint(root: Path) -> bool:
    """config.json beside safetensors weights (one file, shards, or their index): what `qcompile
    compile` takes as input."""
    if not os.path.isfile(root / "config.json"):
        return False
    return os.path.isfile(root / CHECKPOINT_INDEX) or any(os.path.isfile(p) for p in root.glob("*.safetensors"))


def require(manifest: Mapping[str, Any], root: str | Path, *fields: str) -> None:
    """Each dotted field (`spec.vocab_size`, `kv_cache`) must be in the manifest (its type was checked
    on read); an ArtifactFormatError names the first that is not."""
    for dotted in fields:
        value: Any = manifest
        for part in dotted.split("."):
            if not isinstance(value, Mapping) or part not in value:
                raise ArtifactFormatError(f"{Path(root) / MANIFEST}: {dotted} is missing")
            value = value[part]


def artifact_path(root: str | Path, rel: str, *, listed: Container[str] | None = None) -> Path:
    """`root / rel`, confined to the artifact (the module docstring): a regular file reached through
    no link; with `listed` (the manifest's `files`) also one the manifest lists. Raises
    ArtifactFormatError naming the file otherwise, a missing one included."""
    path = _confined(Path(root), rel, listed)
    if path is None:
        raise ArtifactFormatError(f"{Path(root) / rel}: missing")
    return path


def optional_artifact_path(root: str | Path, rel: str, *, listed: Container[str] | None = None) -> Path | None:
    """artifact_path, or None when nothing is at `rel` (a file the artifact may leave out)."""
    return _confined(Path(root), rel, listed)


def _confined(root: Path, rel: str, listed: Container[str] | None) -> Path | None:
    pure = check_relative_path(rel)
    path = root
    for depth, part in enumerate(pure.parts, 1):
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            if listed is not None and rel in listed:
                raise ArtifactFormatError(f"{root / rel}: missing (manifest.json lists it)") from None
            return None
        except OSError as exc:
            raise ArtifactFormatError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        last = depth == len(pure.parts)
        if stat.S_ISLNK(mode):
            if not (last and _hub_blob(root, path)):
                raise ArtifactFormatError(f"{path}: {LINK_REFUSED}")
            mode = os.stat(path).st_mode
        if not last and not stat.S_ISDIR(mode):
            raise ArtifactFormatError(f"{path}: not a directory")
    if not stat.S_ISREG(mode):
        raise ArtifactFormatError(f"{path}: not a regular file")
    if listed is not None and rel not in listed:
        raise ArtifactFormatError(
            f"{path}: not listed in manifest.json `files`; only files the manifest vouches for are read"
        )
    return path


def _hub_blob(root: Path, link: Path) -> bool:
    """Whether `link`, in the artifact at `root`, is a Hugging Face cache snapshot's link to a regular
    file directly in its `models--*/blobs/` (the module docstring)."""
    snapshots = root.absolute().parent
    repo = snapshots.parent
    if snapshots.name != "snapshots" or not repo.name.startswith("models--"):
        return False
    blobs = repo / "blobs"
    if os.path.islink(blobs) or os.path.islink(snapshots) or os.path.islink(repo):
        return False
    target = Path(os.path.realpath(link))
    return target.parent == Path(os.path.realpath(blobs)) and target.is_file() and not target.is_symlink()


def find_links(root: str | Path) -> list[str]:
    """Every symbolic link under `root` (files and directories; a linked directory is not entered),
    as relative paths, less a Hugging Face cache snapshot's links to its blobs."""
    root = Path(root)
    found = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        for name in [*dirs, *files]:
            path = here / name
            if path.is_symlink() and not (name in files and _hub_blob(root, path)):
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def check_relative_path(rel: str) -> PurePosixPath:
    """A manifest path must be relative, normalised and stay inside the artifact dir."""
    pure = PurePosixPath(rel)
    if not rel or pure.is_absolute() or ".." in pure.parts or str(pure) != rel or "\\" in rel:
        raise ArtifactFormatError(f"manifest path {rel!r} is not a normalised path inside the artifact")
    return pure


def sha256_file(path: Path, block: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(block)
        view = memoryview(buffer)
        while got := handle.readinto(buffer):
            digest.update(view[:got])
    return digest.hexdigest()


def verify_files(root: str | Path, manifest: dict[str, Any] | None = None, progress=None) -> list[FileProblem]:
    """Check every file the manifest lists (size, then sha256), in manifest order.

    Returns the problems found (empty when the artifact verifies). `progress(path)` is called
    after each file.
    """
    root = Path(root)
    manifest = manifest if manifest is not None else read_manifest(root)
    if manifest.get("synthetic"):
        reason = "a SYNTHETIC artifact: its weights are random, made at load; it has nothing to verify or publish"
        return [FileProblem(MANIFEST, reason)]
    problems: list[FileProblem] = []
    for rel, info in manifest["files"].items():
        problem = file_problem(root, rel, info, hashes=True)
        if problem is not None:
            problems.append(problem)
        if progress is not None:
            progress(rel)
    return problems


def file_problem(root: Path, rel: str, info: Mapping[str, Any], *, hashes: bool) -> FileProblem | None:
    """What is wrong with listed file `rel` (confinement, then size, then with `hashes` its sha256), or None."""
    try:
        path = _confined(root, rel, None)
    except ArtifactFormatError as exc:
        text = str(exc)
        reason = (
            text.removeprefix(f"{root / rel}: ")
            if text.startswith(f"{root / rel}: ")
            else text.removeprefix(f"{root}/")
        )
        return FileProblem(rel, reason)
    if path is None:
        return FileProblem(rel, "missing")
    size = path.stat().st_size
    if size != info.get("bytes"):
        return FileProblem(rel, f"size {size} != manifest {info.get('bytes')}")
    if hashes and sha256_file(path) != info.get("sha256"):
        return FileProblem(rel, "sha256 does not match the manifest")
    return None
