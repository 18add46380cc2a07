"""bench/spec_step_profile.py on CPU: a compiled artifact's plain and speculating engines are profiled
step by step (host parts, and a torch.profiler pass of host ops), a config holding commas is taken
whole by --method, and an artifact without a manifest is refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import spec_step_profile  # noqa: E402 -- bench/ is scripts, not a package


def test_an_artifact_is_profiled_per_step_with_its_host_ops(tiny_ckpt, compiled, tmp_path):
    art = compiled(tiny_ckpt, "bf16")
    out = tmp_path / "profile.json"
    method = "prompt-lookup:adaptive=false,num_tokens=3"
    argv = ["--artifact", str(art), "--device", "cpu", "--batches", "2", "--max-tokens", "12", "--input-len", "24"]
    spec_step_profile.main([*argv, "--methods", "", "--method", method, "--torch-profile", "4", "--out", str(out)])
    report = json.loads(out.read_text())
    for key in ("benchmark", "date", "command", "git_commit", "machine", "versions"):
        assert report[key], key
    assert report["artifact"] == str(art)
    rows = report["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("plain", 2), (method, 2)]
    for row, least in zip(rows, (12, 12 // 4), strict=True):  # a verification may keep k + 1 = 4 tokens
        parts = row["parts"]
        assert row["tokens"] == 2 * 12 and parts["step"]["calls"] == row["steps"] >= least, row
        assert parts["prepare"]["calls"] >= parts["eager"]["calls"] > 0  # CPU: every forward is an eager plan
        profile = row["torch_profile"]
        assert profile["tokens_per_prompt"] == 4 and profile["steps"] >= 4, profile
        assert profile["host_ops"] and all(op["calls_per_step"] > 0 for op in profile["host_ops"].values())
    assert rows[0].get("speculative") is None
    spec = rows[1]["parts"]
    if rows[1]["speculative"]["verifications"]:  # one verify call a step whose requests carried drafts
        assert 1 <= spec["verify"]["calls"] <= rows[1]["speculative"]["verifications"], rows[1]
    else:
        assert "verify" not in spec


def test_an_artifact_without_a_manifest_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        spec_step_profile.main(["--artifact", str(tmp_path), "--device", "cpu"])
    assert info.value.code == 2 and f"--artifact {tmp_path}: no manifest.json" in capsys.readouterr().err
