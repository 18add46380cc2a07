"""relist_files (qcompile.compile.manifest): a file the artifact rewrites in place after compile (the
kernel table `qcompile tune` writes) is recorded again in manifest.json, which verifies after it."""

from __future__ import annotations

import json
import shutil

import pytest
from qruntime.artifact import read_manifest, verify_files

from qcompile.compile.manifest import relist_files, write_listed_json
from qcompile.errors import QCompileError


def test_a_rewritten_file_verifies_once_relisted(tiny_ckpt, compiled, tmp_path, rng):
    art = tmp_path / "art"
    shutil.copytree(compiled(tiny_ckpt, "ptpc-fp8"), art)
    table = art / "kernels" / "GPU_X.json"
    table.parent.mkdir(exist_ok=True)
    table.write_text(json.dumps({"device": "GPU X", "entries": {}, "seed": rng.randrange(1 << 30)}))
    manifest = read_manifest(art)
    relist_files(art, manifest, ["kernels/GPU_X.json"])
    assert verify_files(art, read_manifest(art)) == []
    table.write_text(table.read_text().replace("GPU X", "GPU Y"))  # rewritten again, same size
    assert [p.path for p in verify_files(art, read_manifest(art))] == ["kernels/GPU_X.json"]
    relist_files(art, read_manifest(art), ["kernels/GPU_X.json"])
    assert verify_files(art, read_manifest(art)) == [] and not (art / ".manifest.tmp").exists()


def test_write_listed_json_writes_lists_and_refuses_a_link(tiny_ckpt, compiled, tmp_path, rng):
    """What `qcompile tune` writes (the kernel table, the kernel build list): the file whole, listed,
    verifying; a folder that is a symbolic link out of the artifact refused before anything is written."""
    art = tmp_path / "art"
    shutil.copytree(compiled(tiny_ckpt, "ptpc-fp8"), art)
    data = {"device": "GPU X", "kernels": [], "seed": rng.randrange(1 << 30)}
    path = write_listed_json(art, read_manifest(art), "kernel_builds/GPU_X.json", data)
    assert path == art / "kernel_builds" / "GPU_X.json" and json.loads(path.read_text()) == data
    assert "kernel_builds/GPU_X.json" in read_manifest(art)["files"] and verify_files(art, read_manifest(art)) == []
    assert not list(art.rglob("*.tmp"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (art / "linked").symlink_to(outside, target_is_directory=True)
    with pytest.raises(QCompileError, match=r"linked/GPU_X.json: a symbolic link in the artifact"):
        write_listed_json(art, read_manifest(art), "linked/GPU_X.json", data)
    assert list(outside.iterdir()) == [] and "linked/GPU_X.json" not in read_manifest(art)["files"]
