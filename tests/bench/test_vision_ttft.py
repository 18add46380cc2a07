"""bench/vision_ttft.py on CPU (--tiny): a tiny-vl checkpoint synthesized and compiled (ptpc-fp8), then
every part of the time to first token measured against transformers on the same checkpoint; the JSON
has what a bench report carries, the parts add up and both models see the same prompt."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import vision_ttft  # noqa: E402 -- bench/ is scripts, not a package

PARTS = ("preprocess_ms", "encoder_ms", "prepare_ms", "engine_ms", "ttft_ms", "encoder_batch_ms")  # measured


@pytest.mark.parametrize("sparse", [False, True])
def test_tiny_run_reports_every_part(tmp_path, sparse, rng):
    out = tmp_path / "report.json"
    seed = rng.randrange(1 << 20)
    argv = ["--tiny", "--workdir", str(tmp_path / "work"), "--out", str(out), "--seed", str(seed)]
    vision_ttft.main(argv + (["--sparse"] if sparse else []))
    report = json.loads(out.read_text())
    assert report["benchmark"] == "vision_ttft" and report["device"] == "cpu" and "not a measurement" in report["note"]
    for key in ("date", "command", "git_commit", "machine", "versions", "settings", "build", "artifact", "engine"):
        assert report[key], key
    assert report["settings"]["preset"] == "tiny-vl" and report["settings"]["sparse"] is sparse
    results = report["results"]
    assert results["image_tokens"] == (48 // 8) ** 2  # a 48 x 48 image, one token per 8 x 8 pixels
    assert results["prompt_tokens"] == results["image_tokens"] + 8 + 2
    for part in PARTS:
        assert results[part] > 0, part
    assert results["ttft_ms"] == pytest.approx(results["preprocess_ms"] + results["engine_ms"])
    # derived (on a busy 2-core CPU, medians of 2 runs can make it negative; on a GPU it is the prefill)
    assert results["prefill_ms"] == pytest.approx(results["engine_ms"] - results["prepare_ms"] - results["encoder_ms"])
    assert results["encoder_images_per_s"] == pytest.approx(2 / results["encoder_batch_ms"] * 1e3)
    hf = results["transformers"]
    assert hf["forward_ms"] > 0 and hf["encoder_images_per_s"] > 0
    assert results["speedup_ttft"] == pytest.approx(hf["forward_ms"] / results["engine_ms"])
    vocab = 544  # tiny-vl's
    assert 0 <= results["first_token"] < vocab and 0 <= hf["first_token"] < vocab
