"""Artifact format 1: reading manifest.json and verifying file hashes.

Shared by the runtime (`load(..., verify=True)`) and the compiler (`qcompile verify`), so both
sides check an artifact the same way.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

FORMAT_VERSION = "1.0"
MANIFEST = "manifest.json"


class ArtifactFormatError(Exception):
    """The artifact is missing, malformed, of an unknown format version, or fails verification."""


@dataclass(frozen=True)
class FileProblem:
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def read_manifest(root: str | Path) -> dict[str, Any]:
    """Read and sanity-check ART/manifest.json (format version, file table)."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise ArtifactFormatError(f"{path}: not found; is {root} a qcompile artifact?")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactFormatError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(manifest, dict):
        raise ArtifactFormatError(f"{path}: expected a JSON object")
    version = manifest.get("format_version")
    if not isinstance(version, str) or version.split(".")[0] != FORMAT_VERSION.split(".")[0]:
        raise ArtifactFormatError(
            f"{path}: artifact format_version {version!r} is not supported by this runtime, "
            f"which reads format {FORMAT_VERSION}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ArtifactFormatError(f"{path}: 'files' must map relative paths to {{sha256, bytes}}")
    for rel in files:
        check_relative_path(rel)
    return manifest


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
        path = root / check_relative_path(rel)
        if not path.is_file():
            problems.append(FileProblem(rel, "missing"))
        elif path.stat().st_size != info.get("bytes"):
            problems.append(FileProblem(rel, f"size {path.stat().st_size} != manifest {info.get('bytes')}"))
        elif sha256_file(path) != info.get("sha256"):
            problems.append(FileProblem(rel, "sha256 does not match the manifest"))
        if progress is not None:
            progress(rel)
    return problems
