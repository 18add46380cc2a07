"""qruntime's side of the artifact contract: manifest reading, version refusal, hash checks,
and the promise that the runtime never imports the compiler or llm-compressor."""

import json
import subprocess
import sys

import pytest
from qruntime.artifact import ArtifactFormatError, check_relative_path, read_manifest, verify_files
from qruntime.kv_layout import KV_LAYOUTS


def _artifact(tmp_path, files=None, version="1.0"):
    (tmp_path / "weights").mkdir()
    payload = b"\x01\x02" * 1000
    (tmp_path / "weights" / "a.bin").write_bytes(payload)
    import hashlib

    entry = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
    manifest = {"format_version": version, "files": files if files is not None else {"weights/a.bin": entry}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


def test_reads_and_verifies(tmp_path):
    root = _artifact(tmp_path)
    manifest = read_manifest(root)
    assert verify_files(root, manifest) == []
    (root / "weights" / "a.bin").write_bytes(b"\x01\x02" * 999 + b"\x01\x03")
    problems = verify_files(root, manifest)
    assert [str(p) for p in problems] == ["weights/a.bin: sha256 does not match the manifest"]
    (root / "weights" / "a.bin").write_bytes(b"short")
    assert "size 5 != manifest 2000" in str(verify_files(root, manifest)[0])
    (root / "weights" / "a.bin").unlink()
    assert str(verify_files(root, manifest)[0]) == "weights/a.bin: missing"


def test_unknown_major_version_names_both(tmp_path):
    root = _artifact(tmp_path, version="2.0")
    with pytest.raises(
        ArtifactFormatError, match=r"format_version '2\.0' is not supported by this runtime, which reads format 1\.0"
    ):
        read_manifest(root)


@pytest.mark.parametrize("bad", ["/etc/passwd", "../outside", "weights/../../x", "weights//a", "./a", "a\\b", ""])
def test_paths_must_stay_inside(tmp_path, bad):
    with pytest.raises(ArtifactFormatError, match="not a normalised path inside the artifact"):
        check_relative_path(bad)
    root = _artifact(tmp_path, files={bad: {"sha256": "0", "bytes": 0}})
    with pytest.raises(ArtifactFormatError):
        read_manifest(root)


def test_missing_and_malformed_manifest(tmp_path):
    with pytest.raises(ArtifactFormatError, match="not found; is .* a qcompile artifact"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(ArtifactFormatError, match="malformed JSON"):
        read_manifest(tmp_path)


def test_kv_layout_shapes():
    k, v = KV_LAYOUTS["x-packed"].shapes(10, 16, 4, 128, "bf16")
    assert k == (10, 4, 16, 16, 8) and v == (10, 4, 2, 128, 8)
    k, v = KV_LAYOUTS["x-packed"].shapes(10, 32, 4, 128, "fp8_e4m3")
    assert k == (10, 4, 8, 32, 16) and v == (10, 4, 2, 128, 16)
    assert KV_LAYOUTS["hnd"].shapes(3, 16, 2, 64, "bf16")[0] == (3, 2, 16, 64)
    with pytest.raises(ValueError, match="divisible by 16"):
        KV_LAYOUTS["x-packed"].check(16, 72, "fp8_e4m3")


def test_runtime_imports_neither_compiler_nor_llmcompressor():
    code = (
        "import sys, qruntime, qruntime.artifact, qruntime.kv_layout; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('qcompile', 'llmcompressor', 'compressed_tensors', 'transformers')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
