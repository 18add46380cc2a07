"""bench/spec_extrapolate.py: the batch-1 model of speculative decoding on a large target, from the
decode bench's TPOT and tuned GEMM times, the trained pair's tokens per verification and the
profile's host time, computed on small hand-made inputs whose answer is worked out here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import spec_extrapolate  # noqa: E402 -- bench/ is scripts, not a package

TUNED = {  # ms of 1 layer's GEMMs: 0.010 + 0.020 at M = 1, 0.012 + 0.025 at M = 8, 0.013 + 0.030 at M = 16
    "PTPCLinear:64x64": {"1": ["triton", 10.0, 20.0], "8": ["triton", 12.0, 20.0], "16": ["triton", 13.0, 20.0]},
    "PTPCLinear:128x64": {"1": ["triton", 20.0, 30.0], "8": ["triton", 25.0, 30.0], "16": ["triton", 30.0, 30.0]},
    "GroupedMoE:8x64": {"1": ["triton", 99.0, 99.0], "8": ["triton", 999.0, 999.0]},  # not a dense GEMM: left out
}


def _row(method: str, task: str, k: int, tokens: float, verifications: int, output: int, passes: int = 2) -> dict:
    return {
        "method": method,
        "speculative": {"method": method.split(":")[0], "num_tokens": k},
        "task": task,
        "batch": 1,
        "tokens_per_verification": tokens,
        "verifications": verifications,
        "output_tokens": output,
        "spec_pass_tokens_per_s": [1.0] * passes,
    }


def _write(tmp_path: Path) -> list[str]:
    decode = {
        "machine": {"gpu": "a GPU"},
        "decode": [{"batch": 64, "tpot_ms": 9.0, "floor_ms": 9.0}, {"batch": 1, "tpot_ms": 4.0, "floor_ms": 3.0}],
        "tuned": TUNED,
    }
    spec = {
        "artifacts": {"target": {"num_hidden_layers": 16, "speculative": {"draft_layers": [3, 9, 12, 14]}}},
        "results": [
            _row("prompt-lookup:num_tokens=12", "edit", 12, 6.0, 40, 200),  # 240 of 400 tokens verified
            _row("draft-model", "free", 4, 4.0, 100, 200),  # 400 of 400
            _row("layer-skip", "free", 4, 4.0, 100, 200),
            {**_row("draft-model", "free", 4, 4.0, 100, 200), "batch": 8},  # batch 8: not modelled
        ],
    }
    profile = {
        "rows": [
            {"mode": "plain", "batch": 1, "ms_per_token_per_request": 0.5, "parts": {}},
            {
                "mode": "prompt-lookup:adaptive=false",
                "batch": 1,
                "parts": {"step": {"ms_per_step": 1.0}, "gpu_forward": {"ms_per_step": 0.6}},
            },
        ]
    }
    paths = []
    for name, data in (("decode", decode), ("spec", spec), ("profile", profile)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        paths.append(str(tmp_path / f"{name}.json"))
    return paths


def test_each_method_is_modelled_from_its_inputs(tmp_path):
    decode, spec, profile = _write(tmp_path)
    out = tmp_path / "out.json"
    argv = ["--decode", decode, "--spec", spec, "--profile", profile, "--draft-ms", "0.5", "--preset", "qwen3-8b"]
    report = spec_extrapolate.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == report["rows"]
    assert "a GPU" in report["device"] and report["device"].startswith("none: a model")
    assert report["inputs"]["layers"] == 36 and report["inputs"]["host_ms"] == pytest.approx(0.4)
    rows = {r["method"]: r for r in report["rows"]}
    assert len(report["rows"]) == 3  # batch 8 is not modelled
    # prompt lookup, k = 12: M = 13 runs the M = 16 configs, 36 layers of (0.013 + 0.030 - 0.030) ms more
    lookup = rows["prompt-lookup:num_tokens=12"]
    verify = 4.0 + 36 * 0.013
    assert lookup["verify_ms"] == pytest.approx(verify, abs=1e-3) and lookup["draft_step_ms"] == 0
    assert lookup["verified_share"] == pytest.approx(0.6)
    per_token = 0.6 * (0.4 + verify) / 6.0 + 0.4 * 4.0
    assert lookup["ms_per_token"] == pytest.approx(per_token, abs=1e-3)
    assert lookup["speedup"] == pytest.approx(4.0 / per_token, abs=1e-3)
    assert lookup["over_floor"] == pytest.approx(per_token / 3.0, abs=1e-3)
    # draft model, k = 4: M = 5 runs the M = 8 configs; 4 draft steps of 0.5 ms
    verify = 4.0 + 36 * 0.007
    assert rows["draft-model"]["round_ms"] == pytest.approx(0.4 + 4 * 0.5 + verify, abs=1e-3)
    assert rows["draft-model"]["ms_per_token"] == pytest.approx((0.4 + 2.0 + verify) / 4.0, abs=1e-3)
    # layer skip: 12 of 16 layers kept, each draft step 0.75 of the target's TPOT
    assert rows["layer-skip"]["draft_step_ms"] == pytest.approx(3.0)
    assert rows["layer-skip"]["round_ms"] == pytest.approx(0.4 + 4 * 3.0 + verify, abs=1e-3)


def test_the_draft_step_comes_from_a_profile_and_missing_rows_are_named(tmp_path):
    decode, spec, profile = _write(tmp_path)
    argv = ["--decode", decode, "--spec", spec, "--profile", profile]
    report = spec_extrapolate.main([*argv, "--draft-profile", profile])
    assert report["inputs"]["draft_ms"] == 0.5  # the profile's plain row
    assert {r["method"] for r in spec_extrapolate.main(argv)["rows"]} == {"prompt-lookup:num_tokens=12", "layer-skip"}
    (tmp_path / "empty.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="no batch-1 'prompt-lookup:adaptive=false' row"):
        spec_extrapolate.main(["--decode", decode, "--spec", spec, "--profile", str(tmp_path / "empty.json")])
    with pytest.raises(SystemExit, match="no batch-1 plain row"):
        spec_extrapolate.main([*argv, "--draft-profile", str(tmp_path / "empty.json")])
