"""bench/read_ahead_ab.py on CPU: each variant's trial in a fresh process, the artifact's pages
evicted first, reports the load's split, and a variant it does not know is refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import read_ahead_ab  # noqa: E402 -- bench/ is scripts, not a package


def test_every_variant_is_timed_in_a_fresh_process(tiny_ckpt, compiled, tmp_path):
    art = compiled(tiny_ckpt, "ptpc-fp8")
    out = tmp_path / "ab.json"
    argv = ["--artifact", str(art), "--device", "cpu", "--variants", "none,threads=3,idle=2", "--repeats", "1"]
    read_ahead_ab.main([*argv, "--drop", "artifact", "--out", str(out)])
    report = json.loads(out.read_text())
    for key in ("benchmark", "date", "command", "git_commit", "machine", "versions"):
        assert report[key], key
    assert [t["variant"] for t in report["trials"]] == ["none", "threads=3", "idle=2"]
    assert report["io_scheduler"] is None or "[" in report["io_scheduler"]
    for trial in report["trials"]:
        print(trial)
        assert trial["imports"] > 0.05 and trial["weights"] >= 0  # the child imported torch through the load
        assert trial["total"] <= trial["to_loaded_s"] + 0.005


@pytest.mark.parametrize("variant", ["threads=0", "threads=x", "idle=", "lukewarm"])
def test_an_unknown_variant_is_refused_by_name(tmp_path, capsys, variant):
    with pytest.raises(SystemExit) as info:
        read_ahead_ab.main(["--artifact", str(tmp_path), "--device", "cpu", "--variants", f"none,{variant}"])
    assert info.value.code == 2 and repr(variant) in capsys.readouterr().err
