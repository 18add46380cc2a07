"""bench/verify_rows_bench.py on CPU: it times CUDA graphs, so here it only refuses, saying why; a cell
the KV cache cannot hold is refused first, naming the option to raise. The timing runs on the device
(bench/results/verify_rows_*.json)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import verify_rows_bench  # noqa: E402


def test_without_cuda_graphs_it_says_so(tmp_path):
    argv = ["--preset", "tiny", "--device", "cpu", "--batches", "1", "--contexts", "8", "--kv-cache-gib", "0.01"]
    with pytest.raises(SystemExit, match="times CUDA graphs: run it on a GPU"):
        verify_rows_bench.main([*argv, "--workdir", str(tmp_path)])


def test_a_cell_the_cache_cannot_hold_is_refused(tmp_path):
    argv = ["--preset", "tiny", "--device", "cpu", "--batches", "64", "--contexts", "500", "--kv-cache-gib", "0.002"]
    with pytest.raises(SystemExit, match="give more --kv-cache-gib"):
        verify_rows_bench.main([*argv, "--workdir", str(tmp_path)])


def test_an_artifact_without_a_manifest_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        verify_rows_bench.main(["--artifact", str(tmp_path), "--device", "cpu"])
    assert exited.value.code == 2 and "no manifest.json there" in capsys.readouterr().err
