"""The qcompile-runtime wheel that `qcompile publish` bundles with an artifact.

Built at publish time from the runtime's source (the repo's runtime/, found through the editable
install of qruntime), offline: pip with `--no-build-isolation --no-index` and the setuptools of this
environment, on a copy of the source (the source tree gets no build/ directory). Zip timestamps are
pinned through SOURCE_DATE_EPOCH, so the same source gives the same wheel bytes and re-publishing
gives the same card. Without the source (qcompile installed from a wheel), a wheel an earlier
publish bundled in the artifact (ART/runtime/) is used instead, and only when the artifact's
manifest lists it with its sha256 (the copy is checked against it). A file under ART/runtime/ that
the manifest does not list is refused either way: publish ships no code it did not build or the
manifest does not vouch for.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlparse

from qruntime.artifact import ArtifactFormatError, artifact_path, find_links, sha256_file

from qcompile.errors import PublishError

DIST = "qcompile-runtime"
WHEEL_DIR = "runtime"
WHEEL_GLOB = "qcompile_runtime-*-py3-none-any.whl"
# 1980-01-01, the earliest time a zip entry can carry: every entry gets it, whatever the files' mtimes
SOURCE_DATE_EPOCH = "315532800"
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".*")


def runtime_source() -> Path | None:
    """The runtime's source directory (pyproject.toml of qcompile-runtime + qruntime/), or None.

    Looked up where the installed distribution says its editable source is (PEP 610
    direct_url.json), then beside the imported qruntime package."""
    candidates = []
    try:
        direct = metadata.distribution(DIST).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        direct = None
    if direct:
        try:
            info = json.loads(direct)
        except json.JSONDecodeError:
            info = {}
        url = urlparse(info.get("url", ""))
        if info.get("dir_info", {}).get("editable") and url.scheme == "file":
            candidates.append(Path(unquote(url.path)))
    spec = importlib.util.find_spec("qruntime")
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent.parent)
    return next((path for path in candidates if _is_runtime_source(path)), None)


def _is_runtime_source(path: Path) -> bool:
    pyproject = path / "pyproject.toml"
    if not (pyproject.is_file() and (path / "qruntime" / "__init__.py").is_file()):
        return False
    try:
        return tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}).get("name") == DIST
    except (OSError, tomllib.TOMLDecodeError):
        return False


def build_wheel(source: Path, out_dir: Path) -> Path:
    """Build the wheel of the runtime at `source` into `out_dir`; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qcompile-runtime-build.") as work:
        tree = Path(work) / "src"
        shutil.copytree(source, tree, ignore=_IGNORED)
        command = [
            sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
            "--disable-pip-version-check", "--quiet", str(tree), "--wheel-dir", str(Path(work) / "wheel"),
        ]  # fmt: skip
        env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH, "PIP_NO_INPUT": "1"}
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
        built = sorted((Path(work) / "wheel").glob(WHEEL_GLOB))
        if done.returncode != 0 or len(built) != 1:
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise PublishError(
                f"building the runtime wheel from {source} failed (pip exit {done.returncode}): {tail or 'no wheel'}; "
                "it needs pip and setuptools in this environment and builds offline"
            )
        return Path(shutil.copy2(built[0], out_dir / built[0].name))


def bundled_wheel(artifact: Path, listed: Mapping[str, Mapping[str, object]]) -> Path | None:
    """The runtime wheel an earlier publish left in `artifact`/runtime/ and the manifest lists (`listed`:
    its `files`), when there is exactly one; any file there the manifest does not list is a PublishError."""
    folder = artifact / WHEEL_DIR
    if not os.path.lexists(folder):
        return None
    if folder.is_symlink() or not folder.is_dir():
        raise PublishError(f"{folder}: not a directory of the artifact (a link or a file); remove it")
    present = sorted(f"{WHEEL_DIR}/{name}" for name in os.listdir(folder))
    planted = [rel for rel in present if rel not in listed] + [f"{WHEEL_DIR}/{rel}" for rel in find_links(folder)]
    if planted:
        raise PublishError(
            f"{artifact / planted[0]}: not listed in manifest.json `files` (or a link); publish bundles only a runtime "
            "wheel it builds from the installed qruntime or one the manifest lists with its sha256: remove it"
        )
    found = [rel for rel in present if PurePosixPath(rel).match(WHEEL_GLOB)]
    if len(found) != 1:
        return None
    try:
        return artifact_path(artifact, found[0], listed=listed)
    except ArtifactFormatError as exc:
        raise PublishError(str(exc)) from exc


def runtime_wheel(artifact: Path, out_dir: Path, listed: Mapping[str, Mapping[str, object]]) -> tuple[Path, str]:
    """(the wheel to bundle, where it came from): built from the runtime's source, else the one
    bundled in the artifact and listed in its manifest (`listed`: the manifest's `files`, the copy
    checked against its sha256); an error saying how to get either when there is neither."""
    bundled = bundled_wheel(artifact, listed)  # refuses an unlisted file under runtime/ in either case
    source = runtime_source()
    if source is not None:
        return build_wheel(source, out_dir), f"built from {source}"
    if bundled is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        copy = Path(shutil.copyfile(bundled, out_dir / bundled.name))
        rel = f"{WHEEL_DIR}/{bundled.name}"
        if sha256_file(copy) != listed[rel].get("sha256"):
            raise PublishError(f"{bundled}: its sha256 is not the one manifest.json lists; the wheel is not bundled")
        return copy, f"the wheel bundled in {artifact}"
    raise PublishError(
        f"the runtime's source is not available to build its wheel (qruntime is installed at "
        f"{_installed_at()}, not as an editable install of a qcompile checkout's runtime/), and {artifact} "
        f"bundles no {WHEEL_DIR}/{WHEEL_GLOB} that its manifest lists; install from a source checkout "
        "(`pip install -e ./runtime -e .`) and publish again"
    )


def _installed_at() -> str:
    spec = importlib.util.find_spec("qruntime")
    return str(Path(spec.origin).parent) if spec is not None and spec.origin else "nowhere"
