"""bench/tp_lifecycle.py on CPU (gloo): a tp=2 engine's load, decode, close and exit are timed, and a
phase that outlasts the timeout is reported as a hang with the process group killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "lifecycle.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(ROOT / "bench" / "tp_lifecycle.py"), "--device", "cpu", "--out", str(out)]
    cmd += ["--workdir", str(tmp_path / "work"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_every_phase_of_a_tp2_engine_ends(tmp_path):
    proc, report = _bench(tmp_path, "--runs", "tiny-moe:2", "--tokens", "6", "--timeout", "120")
    (row,) = report["runs"]
    assert row["returncode"] == 0 and "hung_in" not in row, proc.stdout + proc.stderr
    assert set(row["phases"]) == {"load", "decode", "close", "exit"}
    assert row["tokens"] == 6 and row["graphs"] is False  # CPU engines capture no graphs
    assert all(0 <= s < 120 for s in row["phases"].values())
    assert report["benchmark"] == "tp_lifecycle" and "command" in report
    assert not list((tmp_path / "work").iterdir())  # the artifact is removed after the run


def test_a_phase_past_the_timeout_is_a_hang_and_the_group_is_killed(tmp_path):
    proc, report = _bench(tmp_path, "--runs", "tiny-moe:2", "--timeout", "0.5")
    (row,) = report["runs"]
    assert row["hung_in"] == "load" and row["returncode"] == -9
    assert "no end of 'load'" in proc.stdout and "HUNG in load" in proc.stdout
    assert "(most recent call first)" in proc.stderr  # rank 0's stacks, dumped by faulthandler on SIGUSR1
