"""relist_files (qcompile.compile.manifest): a file the artifact rewrites in place after compile (the
kernel table `qcompile tune` writes) is recorded again in manifest.json, which verifies after it."""

from __future__ import annotations

import json
import shutil

from qruntime.artifact import read_manifest, verify_files

from qcompile.compile.manifest import relist_files


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
