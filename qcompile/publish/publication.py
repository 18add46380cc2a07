"""`qcompile publish ART --to DIR | hf://ORG/NAME`: a verified artifact with its model card and the
runtime wheel, as a folder or uploaded to a Hugging Face hub repository.

The published tree:

    DIR/
      every file the artifact's manifest lists   # byte-identical (hard links where possible)
      README.md                                  # the model card (qcompile/publish/model_card.py)
      runtime/qcompile_runtime-<version>-py3-none-any.whl   # built now (qcompile/publish/runtime_wheel.py)
      reports/*.json                             # the results behind the card's tables
      manifest.json                              # the artifact's, its `files` extended by the three above

so the published tree is an artifact whose every file verifies (`qcompile verify`, `qruntime.load(…,
verify=True)`, the hub upload and download), the card and the wheel included. Publishing a published
folder again drops its earlier card, wheel and reports entries and writes them anew.

Reports. Beside the files its manifest lists, an artifact may hold `reports/*.json`: results as
`qcompile eval --json`, `qcompile eval-recipes --json` or `qcompile bench --json` print them (e.g.
`qcompile eval ART --reference CKPT --data FILE --json > ART/reports/eval.json`). The compiled
artifact's manifest does not list them, so adding one never changes a hash, and the runtime
(`qruntime.load`, `verify=True` included) and `qcompile verify` check only the listed files (verify
notes the others). Publish reads every `reports/*.json` as it reads `--eval FILE` and `--bench FILE`,
renders them in the card and writes them to reports/ of the published tree; a JSON file there that
is none of those outputs is an error; other files under reports/ are left out.

Order of work: verify every file against the manifest (a mismatch is refused, naming the file);
read the reports; build the wheel and render the card in a scratch directory; check the target;
stage the tree in a temporary directory beside the target and rename it into place, so a failure or
Ctrl-C leaves the target as it was. An existing target is replaced without --force only when every
file in it is byte-identical to the one this publish writes at that path (re-publishing the same
artifact); anything else needs --force. A hub target is staged the same way, then handed to
`qcompile.publish.hub.push`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qruntime import bounded_json
from qruntime.artifact import (
    MANIFEST,
    ArtifactFormatError,
    artifact_path,
    sha256_file,
)

from qcompile.compile.manifest import read_compiled, require_verified
from qcompile.errors import PublishError
from qcompile.io.atomic import atomic_output_dir
from qcompile.progress import progress_bar
from qcompile.publish.model_card import CardInputs, base_model_name, render_card
from qcompile.publish.reports import REPORTS, Report, collect_reports
from qcompile.publish.runtime_wheel import WHEEL_DIR, runtime_wheel

CARD = "README.md"
HUB_SCHEME = "hf://"


@dataclass(frozen=True)
class Entry:
    """One file of the published tree."""

    path: str  # relative, posix
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Publication:
    """What a publish wrote (or, with dry_run, would write)."""

    target: str
    entries: tuple[Entry, ...]
    wheel: str  # its path in the tree
    wheel_origin: str
    replaced: bool  # an existing folder is replaced
    dry_run: bool

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries)


def publish(
    artifact: str | Path,
    target: str,
    *,
    evals: Iterable[str | Path] = (),
    benches: Iterable[str | Path] = (),
    base_model: str | None = None,
    dry_run: bool = False,
    force: bool = False,
    progress: bool = True,
) -> Publication:
    """Publish `artifact` to `target` (a folder, or hf://ORG/NAME); see the module docstring."""
    root = Path(artifact)
    hub = target.startswith(HUB_SCHEME)
    if not hub and "://" in target:
        raise PublishError(f"--to {target}: give a folder or {HUB_SCHEME}ORG/NAME")
    dest = None if hub else _check_folder(Path(target).absolute(), root)
    manifest = read_compiled(root, PublishError)
    require_verified(root, manifest, progress, PublishError, "published")
    listed = manifest["files"]  # an earlier publish's wheel included: the one bundled wheel publish may reuse
    manifest = _compiled(manifest)
    reports = collect_reports(root, evals, benches)
    replaced = False
    with tempfile.TemporaryDirectory(prefix="qcompile-publish.") as scratch:
        generated, wheel, origin = _generate(root, manifest, listed, reports, base_model, Path(scratch))
        entries = _entries(manifest, generated)
        if dest is None:
            _publish_hub(root, manifest, generated, entries, target, dry_run=dry_run, force=force, progress=progress)
        else:
            replaced = dest.exists()
            if replaced and not force:
                problem = _differs(dest, root, manifest, entries)
                if problem:
                    raise PublishError(
                        f"{dest}: exists and is not an earlier publish of this artifact ({problem}); "
                        "pass --force to replace it"
                    )
            if not dry_run:
                with atomic_output_dir(dest, force=True) as tmp:  # what may be replaced was checked just above
                    _stage(tmp, root, manifest, generated, entries, progress)
    return Publication(target, tuple(entries.values()), wheel, origin, replaced, dry_run)


def _json_file(root: Path, rel: str, manifest: dict[str, Any]) -> Any:
    """A listed JSON file of the artifact, confined (artifact_path) and bounded (bounded_json); None
    when it is not JSON."""
    try:
        path = artifact_path(root, rel, listed=manifest["files"])
    except ArtifactFormatError as exc:
        raise PublishError(str(exc)) from exc
    try:
        return bounded_json.loads(path.read_bytes(), what=str(path))
    except ValueError:
        return None


def _is_publish_output(rel: str) -> bool:
    """Whether a tree path is one publish writes (card, runtime wheel, reports), not a compiled file."""
    return rel == CARD or rel.startswith((f"{WHEEL_DIR}/", f"{REPORTS}/"))


def _compiled(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest less an earlier publish's entries (publishing a published folder again)."""
    return manifest | {"files": {rel: f for rel, f in manifest["files"].items() if not _is_publish_output(rel)}}


def _generate(
    root: Path,
    manifest: dict[str, Any],
    listed: dict[str, Any],
    reports: tuple[Report, ...],
    base_model: str | None,
    scratch: Path,
) -> tuple[dict[str, Path], str, str]:
    """The wheel, the reports, the card and the published manifest (the artifact's, its `files` extended
    by those three), written under `scratch`: ({tree path: file}, wheel path, the wheel's origin).
    `listed`: the artifact's `files` before an earlier publish's entries were dropped."""
    wheel_file, origin = runtime_wheel(root, scratch / WHEEL_DIR, listed)
    wheel = f"{WHEEL_DIR}/{wheel_file.name}"
    generated = {wheel: wheel_file}
    for report in reports:
        path = scratch / REPORTS / report.name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(report.raw)
        generated[f"{REPORTS}/{report.name}"] = path
    files = {rel: {"sha256": info["sha256"], "bytes": info["bytes"]} for rel, info in manifest["files"].items()}
    files |= {rel: _digest(path) for rel, path in sorted(generated.items())}
    config = _json_file(root, "config.json", manifest) if "config.json" in manifest["files"] else {}
    config = config if isinstance(config, dict) else {}
    inputs = CardInputs(
        manifest=manifest,
        base_model=base_model or base_model_name(manifest["source"]["path"], config),
        files=files,
        wheel=wheel,
        reports=reports,
        tuned=_tuned(root, manifest),
        chat=_has_chat_template(root, manifest),
    )
    card = scratch / CARD
    card.write_text(render_card(inputs), encoding="utf-8")
    generated = {CARD: card, **generated}
    added = {rel: _digest(path) for rel, path in sorted(generated.items())}
    published = scratch / MANIFEST
    published.write_text(json.dumps(manifest | {"files": manifest["files"] | added}, indent=1) + "\n", encoding="utf-8")
    return {MANIFEST: published, **generated}, wheel, origin


def _digest(path: Path) -> dict[str, Any]:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def _tuned(root: Path, manifest: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """(kernels file, GPU name) for every tuned-config file the manifest lists."""
    tuned = []
    for rel in sorted(manifest["files"]):
        if rel.startswith("kernels/") and rel.endswith(".json"):
            table = _json_file(root, rel, manifest)
            device = table.get("device") if isinstance(table, dict) else None
            tuned.append((rel, device if isinstance(device, str) else Path(rel).stem))
    return tuple(tuned)


def _has_chat_template(root: Path, manifest: dict[str, Any]) -> bool:
    if "chat_template.jinja" in manifest["files"]:
        return True
    if "tokenizer_config.json" not in manifest["files"]:
        return False
    config = _json_file(root, "tokenizer_config.json", manifest)
    return isinstance(config, dict) and bool(config.get("chat_template"))


def _entries(manifest: dict[str, Any], generated: dict[str, Path]) -> dict[str, Entry]:
    entries = {rel: Entry(rel, info["bytes"], info["sha256"]) for rel, info in manifest["files"].items()}
    entries |= {rel: Entry(rel, **_digest(path)) for rel, path in generated.items()}
    return dict(sorted(entries.items()))


def _check_folder(dest: Path, root: Path) -> Path:
    """A folder target must be apart from the artifact, and a directory if it exists."""
    art, out = root.resolve(), dest.resolve()
    if art == out or art in out.parents or out in art.parents:
        raise PublishError(f"--to {dest}: is the artifact {root}, inside it or contains it; publish to another folder")
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise PublishError(f"{dest}: exists and is not a directory; refusing to replace it")
    return dest


def _differs(dest: Path, root: Path, manifest: dict[str, Any], entries: dict[str, Entry]) -> str | None:
    """Why replacing `dest` could lose something, or None when each file in it is the one we write."""
    for path in sorted(dest.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            continue
        rel = path.relative_to(dest).as_posix()
        entry = entries.get(rel)
        if entry is None:
            return f"{rel} is not part of it"
        if path.is_symlink() or not path.is_file():
            return f"{rel} is not a regular file"
        if rel in manifest["files"] and _same_file(path, root / rel):
            continue  # a hard link to the verified artifact file
        if path.stat().st_size != entry.bytes or sha256_file(path) != entry.sha256:
            return f"{rel} differs from what this publish writes"
    return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _stage(
    tmp: Path,
    root: Path,
    manifest: dict[str, Any],
    generated: dict[str, Path],
    entries: dict[str, Entry],
    progress: bool,
) -> None:
    """Fill `tmp` with the tree: artifact files hard-linked (copied, and checked, across file systems)."""
    with progress_bar(sum(e.bytes for e in entries.values()), "stage", progress) as bar:
        for rel, entry in entries.items():
            dst = tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if rel in generated:
                shutil.copyfile(generated[rel], dst)
            else:
                _link_or_copy(_confined(root, rel, manifest), dst, entry)
            bar.update(entry.bytes)


def _confined(root: Path, rel: str, manifest: dict[str, Any]) -> Path:
    """The listed artifact file `rel`, reached through no link: publish never links or copies a link."""
    try:
        return artifact_path(root, rel, listed=manifest["files"])
    except ArtifactFormatError as exc:
        raise PublishError(str(exc)) from exc


def _link_or_copy(src: Path, dst: Path, entry: Entry) -> None:
    try:
        os.link(src, dst)
        return
    except OSError:
        pass  # another file system, or links not allowed: copy
    digest = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(16 << 20):
            digest.update(chunk)
            fout.write(chunk)
    if digest.hexdigest() != entry.sha256:
        raise PublishError(f"{src}: changed while it was being published (sha256 no longer matches); publish again")


def _publish_hub(
    root: Path,
    manifest: dict[str, Any],
    generated: dict[str, Path],
    entries: dict[str, Entry],
    target: str,
    *,
    dry_run: bool,
    force: bool,
    progress: bool,
) -> None:
    """Stage the tree beside the artifact (hard links; the system's temp dir when that is not writable)
    and hand it to the hub uploader."""
    from qcompile.publish.hub import push  # huggingface_hub is needed only for hub targets

    # TemporaryDirectory removes itself through a weakref.finalize, so even a signal that lands
    # before the `with` is entered leaves nothing once the process exits
    try:
        scratch = tempfile.TemporaryDirectory(
            prefix=f".{root.name}.publish.", dir=root.absolute().parent, ignore_cleanup_errors=True
        )
    except OSError:
        scratch = tempfile.TemporaryDirectory(prefix="qcompile-publish-stage.", ignore_cleanup_errors=True)
    with scratch as staged:
        _stage(Path(staged), root, manifest, generated, entries, progress)
        push(Path(staged), target, dry_run=dry_run, force=force, progress=progress)
