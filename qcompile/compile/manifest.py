"""Assemble manifest.json: the index of everything in the artifact (ARTIFACT.md, format 1)."""

from __future__ import annotations

import json
import os
import platform
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

from qruntime.artifact import (
    COMPILED_FIELDS,
    FORMAT_VERSION,
    MANIFEST,
    ArtifactFormatError,
    FileProblem,
    find_links,
    read_manifest,
    require,
    sha256_file,
    verify_files,
)

from qcompile.compile.plan import TensorPlan
from qcompile.errors import QCompileError
from qcompile.io.safetensors_stream import DTYPE_NAMES
from qcompile.progress import progress_bar


def toolchain() -> dict[str, str | None]:
    """Versions of what made the artifact (None for a package that is not installed)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("qcompile", "qcompile-runtime", "torch", "onnx", "safetensors", "llmcompressor", "compressed-tensors"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def tensor_table(plan: TensorPlan) -> dict[str, dict[str, Any]]:
    """name -> {file, dtype, shape, role, scheme[, parts, stacked]} for every artifact tensor.

    `parts` lists, per slice along the stack axis, [source tensor, first row, end row] of each
    source in the fused tensor: enough to split it back without the source checkpoint.

    At tp > 1 an entry describes the whole (tp=1) tensor — dtype, shape, role, scheme, parts — and
    how the ranks hold it instead of `file`: `axis` (the axis of `shape` it is split along; null when
    every rank holds all of it) and `ranks`, per rank {file, shape, spans}, `spans` the [begin, end)
    ranges along `axis` whose concatenation is that rank's tensor (absent when axis is null). A
    tensor rank 0 alone holds, whole (a Qwen3-VL vision tower's, role "vision"), keeps its `file`
    (under weights/rank0/) and has neither.
    """
    files = [plan.file_of(rank) for rank in range(plan.tp)]
    table: dict[str, dict[str, Any]] = {}
    for job in plan.jobs:
        for out in job.outputs(plan.source_shapes, plan.model_dtype):
            alone = plan.tp == 1 or out.name in plan.rank0_only
            entry: dict[str, Any] = {"file": files[0][out.name]} if alone else {}
            entry |= {
                "dtype": DTYPE_NAMES[out.dtype],
                "shape": list(out.shape),
                "role": job.role
                if out.name == job.weight_name
                else "zero_point"
                if out.name == job.zero_point_name
                else "scale",
                "scheme": job.scheme,
            }
            if out.name == job.weight_name:
                entry["parts"] = [[list(part) for part in group] for group in job.part_rows(plan.source_shapes)]
                entry["stacked"] = job.stacked
            if not alone:
                split = plan.splits[out.name]
                entry["axis"] = split.axis
                entry["ranks"] = [
                    {"file": files[rank][out.name], "shape": list(split.shape(out.shape))}
                    | ({} if split.axis is None else {"spans": [list(span) for span in split.ranks[rank]]})
                    for rank in range(plan.tp)
                ]
            table[out.name] = entry
    return table


def rank_tensors(manifest: dict[str, Any], rank: int = 0) -> dict[str, dict[str, Any]]:
    """name -> {file, dtype, shape, role, scheme} of the tensors rank `rank` holds, whatever the
    artifact's tp: at tp=1 the table itself, at tp > 1 each entry with that rank's file and shape
    (and rank 0's the tensors it alone holds: a vision tower's)."""
    if manifest.get("tp", 1) == 1:
        return manifest["tensors"]
    return {
        name: info if "ranks" not in info else {k: v for k, v in info.items() if k != "ranks"} | info["ranks"][rank]
        for name, info in manifest["tensors"].items()
        if "ranks" in info or rank == 0
    }


def file_table(root: Path, known: dict[str, str] | None = None, workers: int = 2) -> dict[str, dict[str, Any]]:
    """relative path -> {sha256, bytes} for every file under root except manifest.json.

    `known` holds digests already computed (the weight shards, hashed while written).
    """
    known = known or {}
    paths = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)

    def digest(path: Path) -> str:
        return known.get(path.relative_to(root).as_posix()) or sha256_file(path)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = list(pool.map(digest, paths))
    return {
        p.relative_to(root).as_posix(): {"sha256": digest, "bytes": p.stat().st_size}
        for p, digest in zip(paths, digests, strict=True)
    }


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    manifest = {"format_version": FORMAT_VERSION, **manifest}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def relist_files(root: Path, manifest: dict[str, Any], rels: list[str]) -> None:
    """Record the current size and sha256 of the artifact's files `rels` (rewritten in place, as
    `qcompile tune` rewrites its kernel table) in `manifest`, and replace manifest.json with it
    atomically (written beside, then renamed)."""
    for rel in rels:
        path = root / rel
        manifest["files"][rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    manifest.pop("format_version", None)
    staging = root / ".manifest.tmp"
    staging.mkdir(exist_ok=True)
    write_manifest(staging, manifest)
    os.replace(staging / "manifest.json", root / "manifest.json")
    staging.rmdir()


def write_listed_json(root: Path, manifest: dict[str, Any], rel: str, data: Any) -> Path:
    """Write `data` as the artifact's JSON file `rel` (one folder deep, created; written beside and
    renamed) and list it in the manifest (relist_files); refuses a symbolic link on the way, so
    only the artifact's own files are ever written. Returns the file's path."""
    path = root / rel
    if path.parent.is_symlink() or path.is_symlink():
        raise QCompileError(f"{path}: a symbolic link in the artifact; only the artifact's own files are written")
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    relist_files(root, manifest, [rel])
    return path


def read_compiled(root: Path, error: type[QCompileError]) -> dict[str, Any]:
    """The manifest of a compiled artifact with every field a compiler verb reads (COMPILED_FIELDS),
    or `error` naming what is wrong."""
    try:
        manifest = read_manifest(root)
        require(manifest, root, *COMPILED_FIELDS)
    except ArtifactFormatError as exc:
        raise error(str(exc)) from exc
    return manifest


def require_verified(
    root: Path, manifest: dict[str, Any], progress: bool, error: type[QCompileError], action: str
) -> None:
    """Check every file of `root` against its manifest (with a progress bar over the bytes), and that
    the artifact holds no symbolic link, listed or not; raise `error` naming the first bad file and
    saying the artifact is not `action` (e.g. "exported")."""
    files = manifest["files"]
    problems = [FileProblem(rel, "is a symbolic link (refused)") for rel in find_links(root) if rel not in files]
    with progress_bar(sum(f.get("bytes") or 0 for f in files.values()), "verify", progress) as bar:
        problems += verify_files(root, manifest, progress=lambda rel: bar.update(files[rel].get("bytes") or 0))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise error(
            f"{root / problems[0].path}: {problems[0].reason}{more}; the artifact does not verify against its "
            f"manifest, so it is not {action} (`qcompile verify` lists every bad file)"
        )
