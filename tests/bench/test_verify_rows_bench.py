"""bench/verify_rows_bench.py on CPU (the reference ops, no graphs): every cell is timed and recorded;
a cell the KV cache cannot hold is refused, naming the option to raise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import verify_rows_bench  # noqa: E402


def test_every_cell_is_timed(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--batches", "1,2", "--contexts", "8,20", "--repeats", "2"]
    argv += ["--kv-cache-gib", "0.01"]
    report = verify_rows_bench.main([*argv, "--drafts", "3", "--workdir", str(tmp_path), "--out", str(out)])
    assert [(r["batch"], r["context"]) for r in report["rows"]] == [(1, 8), (1, 20), (2, 8), (2, 20)]
    for row in report["rows"]:
        assert row["drafts"] == 3 and all(row[k] > 0 for k in ("decode_rows_ms", "mixed_ms", "decode_ms")), row
    assert out.is_file() and report["benchmark"] == "verify_rows_bench" and report["preset"] == "tiny"


def test_a_cell_the_cache_cannot_hold_is_refused(tmp_path):
    argv = ["--preset", "tiny", "--device", "cpu", "--batches", "64", "--contexts", "500", "--kv-cache-gib", "0.002"]
    with pytest.raises(SystemExit, match="give more --kv-cache-gib"):
        verify_rows_bench.main([*argv, "--workdir", str(tmp_path)])
