"""bench/spec_bench.py on CPU: a tiny random-weight artifact, every method of the bench (the draft
model is the target itself) on both tasks at two batch sizes, a few tokens each; the JSON has what
a bench report carries and every greedy output equals plain decoding's."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import spec_bench  # noqa: E402 -- bench/ is scripts, not a package
import spec_prompts  # noqa: E402


@pytest.fixture(scope="module")
def tiny_bf16(make_ckpt, compiled) -> Path:
    return compiled(make_ckpt("tiny"), "bf16")


def test_every_method_task_and_batch_is_measured_and_greedy_outputs_match(tiny_bf16, tmp_path):
    out = tmp_path / "spec.json"
    argv = [str(tiny_bf16), "--draft", str(tiny_bf16), "--methods", "prompt-lookup,draft-model"]
    argv += ["--batches", "1,2", "--max-tokens", "6", "--prompt-tokens", "16", "--device", "cpu", "--threads", "1"]
    argv += ["--repeats", "2", "--out", str(out)]
    spec_bench.main(argv)
    report = json.loads(out.read_text())
    assert report["settings"]["repeats"] == 2
    assert report["benchmark"] == "spec_bench" and report["device"] == "cpu" and "not a target" in report["note"]
    for key in ("date", "command", "git_commit", "machine", "versions", "engine", "settings", "artifacts"):
        assert report[key], key
    assert report["versions"]["torch"] and report["settings"]["dtype"] == "float32"
    assert len(report["tasks"]["edit"]["plain_copied_tokens"]) == 2
    rows = report["results"]
    cells = {(r["method"], r["task"], r["batch"]) for r in rows}
    assert cells == {(m, t, b) for m in ("prompt-lookup", "draft-model") for t in ("free", "edit") for b in (1, 2)}
    for row in rows:
        assert row["greedy"] and row["prompts"] == 2 and row["output_tokens"] == 2 * 6
        assert row["identical_to_plain"] == row["prompts"], row  # greedy: the very tokens of plain decoding
        assert 0 <= row["acceptance_rate"] <= 1 and row["preemptions"] == 0
        assert row["spec_tokens_per_s"] > 0 and row["plain_tokens_per_s"] > 0
        assert row["speedup"] == pytest.approx(row["spec_tokens_per_s"] / row["plain_tokens_per_s"], rel=0.01)
        for kind in ("spec", "plain"):  # the median of two passes: their mean
            passes = row[f"{kind}_pass_tokens_per_s"]
            assert len(passes) == 2 and all(p > 0 for p in passes), row
            wall = statistics.mean(row["output_tokens"] / p for p in passes)
            assert row[f"{kind}_tokens_per_s"] == pytest.approx(row["output_tokens"] / wall, rel=0.01), row
        if row["method"] == "draft-model":  # the target drafting for itself: nearly every draft is kept
            assert row["acceptance_rate"] > 0.9 and row["tokens_per_verification"] > 1.5, row


def test_edit_prompts_end_with_the_marker_and_the_functions_first_line():
    sources = ["import os\n\n\nclass A:\n    def f(self, x):\n        y = x + 1\n        z = y * 2\n        return z\n"]
    encode = lambda text: list(text.encode())  # noqa: E731 -- a byte per token
    decode = lambda ids: bytes(ids).decode()  # noqa: E731
    [edit] = spec_prompts.edit_prompts(encode, decode, sources, count=1, max_tokens=20, longest=200)
    code = "def f(self, x):\n    y = x + 1\n    z = y * 2\n    return z"
    assert decode(edit.prompt) == code + spec_prompts.EDIT_MARKER + "def f(self, x):"
    assert decode(edit.copy) == code.removeprefix("def f(self, x):")
    with pytest.raises(SystemExit, match="only 0 held-out functions"):
        spec_prompts.edit_prompts(encode, decode, sources, count=1, max_tokens=200, longest=400)


def test_given_step_counts_train_without_a_probe(tmp_path, monkeypatch):
    """--target-steps / --draft-steps: each model trains exactly that many steps and no step is timed
    first (a time budget's count depends on the machine of the day), recorded in the training's
    record; the tiny plan on CPU."""
    import spec_train

    def no_probe(*args, **kwargs):
        raise AssertionError("a probe ran though the steps were given")

    monkeypatch.setattr(spec_train, "_probe_step_seconds", no_probe)
    # scoring the held-out windows was ~54 of this test's 64 s on a CPU; the step counts do not need it
    monkeypatch.setattr(spec_train.trainer, "mean_nll", lambda *args, **kwargs: 0.0)
    seconds = {"target": 1.0, "draft": 1.0}
    record = spec_train.train_pair(
        spec_train.TRAIN_PLANS["tiny"],
        tmp_path,
        spec_bench.torch.device("cpu"),
        seconds,
        print,
        steps={"target": 3, "draft": 2},
    )
    for name, steps in (("target", 3), ("draft", 2)):
        assert record[name]["train_config"]["steps"] == steps and record[name]["steps_from"] == "given", record[name]
        assert (tmp_path / name / "config.json").is_file()


@pytest.mark.parametrize("argv", [["--target-steps", "0", "--train"], ["--draft-steps", "5"]], ids=["zero", "no-train"])
def test_step_counts_are_refused_unless_positive_and_training(tmp_path, capsys, argv):
    extra = [] if "--train" in argv else [str(tmp_path)]
    with pytest.raises(SystemExit) as info:
        spec_bench.parse_args([*extra, *argv])
    assert info.value.code == 2 and "a positive step count, with --train" in capsys.readouterr().err


def test_a_draft_model_method_in_text_form_takes_the_draft_from_the_command_line(tmp_path):
    args = argparse.Namespace(draft=tmp_path / "d", num_draft_tokens=None)
    config = spec_bench.method_config("draft-model:chain=false,num_tokens=6", args)
    assert (config.draft_model, config.chain, config.num_tokens) == (str(tmp_path / "d"), False, 6)
    assert spec_bench.method_config("draft-model:", args).draft_model == str(tmp_path / "d")
    given = spec_bench.method_config("draft-model:draft_model=/x", args)
    assert given.draft_model == "/x"
    with pytest.raises(SystemExit, match="needs --draft"):
        spec_bench.method_config("draft-model:chain=false", argparse.Namespace(draft=None, num_draft_tokens=None))


class _Engine:
    """Logs its generate calls; no speculation."""

    speculative_stats = None

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        self.runner = type("Runner", (), {"device": spec_bench.torch.device("cpu")})()

    def generate(self, prompts, params):
        self.log.append(self.name)
        return [type("Out", (), {"token_ids": (1, 2), "num_preemptions": 0})() for _ in prompts]


def test_cells_of_several_engines_time_their_passes_in_turn():
    log: list[str] = []
    cells = spec_bench.run_cells([_Engine("a", log), _Engine("b", log)], [[1]] * 4, [None] * 4, 2, repeats=3)
    assert log == ["a", "b"] + ["a", "a", "b", "b"] * 3  # warm-ups, then a pass of each per round
    assert [len(c["pass_tokens_per_s"]) for c in cells] == [3, 3] and cells[0]["output_tokens"] == 8


def test_methods_split_at_commas_that_are_not_a_methods_own_options():
    assert spec_bench.split_methods("draft-model:gate=false,chain=false,layer-skip,prompt-lookup:num_tokens=8,") == [
        "draft-model:gate=false,chain=false",
        "layer-skip",
        "prompt-lookup:num_tokens=8",
    ]
    assert spec_bench.split_methods("prompt-lookup,draft-model") == ["prompt-lookup", "draft-model"]
