"""bench/early_prebuild_ab.py on CPU: each variant's kernels-cold and warm rows in fresh processes
that say which patches they ran with, and a variant it does not know refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import early_prebuild_ab  # noqa: E402 -- bench/ is scripts, not a package


def test_each_variant_runs_both_rows_with_its_patches(tiny_ckpt, compiled, tmp_path):
    art = compiled(tiny_ckpt, "ptpc-fp8")
    out = tmp_path / "ab.json"
    argv = ["--artifact", str(art), "--device", "cpu", "--variants", "early,off:j3", "--repeats", "1"]
    early_prebuild_ab.main([*argv, "--workdir", str(tmp_path / "work"), "--out", str(out)])
    report = json.loads(out.read_text())
    for key in ("benchmark", "date", "command", "git_commit", "machine", "versions"):
        assert report[key], key
    got = [(t["variant"], t["row"]) for t in report["trials"]]
    assert got == [("early", "kernels-cold"), ("early", "warm"), ("off:j3", "kernels-cold"), ("off:j3", "warm")]
    for trial in report["trials"]:
        print(trial)
        assert 0 < trial["load_s"] < trial["to_first_token_s"]
    assert [t["jobs"] for t in report["trials"]][2:] == [3, 3]


def test_a_child_whose_patch_did_not_take_is_not_measured(tiny_ckpt, compiled, tmp_path, monkeypatch):
    art = compiled(tiny_ckpt, "ptpc-fp8")
    monkeypatch.setattr(early_prebuild_ab, "OFF", "")  # "off" that starts the build early all the same
    with pytest.raises(RuntimeError, match="not the variant's patches"):
        early_prebuild_ab.main(["--artifact", str(art), "--device", "cpu", "--variants", "off", "--repeats", "1",
                                "--workdir", str(tmp_path / "work")])  # fmt: skip


@pytest.mark.parametrize("variant", ["late", "early:12", "off:j0", "early:jx"])
def test_an_unknown_variant_is_refused_by_name(tmp_path, capsys, variant):
    with pytest.raises(SystemExit) as info:
        early_prebuild_ab.main(["--artifact", str(tmp_path), "--device", "cpu", "--variants", f"early,{variant}"])
    assert info.value.code == 2 and repr(variant) in capsys.readouterr().err
