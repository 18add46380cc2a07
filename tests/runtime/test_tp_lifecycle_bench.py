"""bench/tp_lifecycle.py on CPU (gloo): a tp=2 engine's load, decode, close and exit are timed, and a
phase that outlasts the timeout is reported as a hang with the process group killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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
    # killed (-9), exited (1) first because a worker still starting died of the SIGUSR1, or died of
    # another signal on the way down (CI once saw -11: rank 0 crashed while its peer was being killed)
    assert row["hung_in"] == "load" and (row["returncode"] < 0 or row["returncode"] == 1), row
    deadline = time.monotonic() + 10  # SIGKILL is sent; the kernel may take a moment to end them
    while _live_members(row["process_group"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_members(row["process_group"]) == []  # nothing of the child's process group runs on
    assert "no end of 'load'" in proc.stdout and "HUNG in load" in proc.stdout
    assert "(most recent call first)" in proc.stderr  # rank 0's stacks, dumped by faulthandler on SIGUSR1


def _live_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that are not zombies (killed workers wait for init to reap them)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live
