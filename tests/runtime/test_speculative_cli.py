"""--speculative on the command line: `qruntime run` / `qcompile run` generate plain greedy's tokens and
report the drafts (--json's `speculative`, the summary line); a bad SPEC is one `error:` line naming
the flag and the problem, from every verb that takes it (run, serve, under both commands) before the
model loads; every --help gives SPEC's format, that it is off by default and that outputs keep the
model's distribution."""

from __future__ import annotations

import io
import json
import random

import pytest
from cli_child import run_in_child
from click.testing import CliRunner
from qruntime.cli import main
from qruntime.commands.run import RunOptions, run

from qcompile.cli import main as qcompile_main

SPEC = "prompt-lookup:prompt_lookup_min=1"
WORDS = ("the", "model", "runs", "fast", "hello", "world", "cache", "tokens")


@pytest.fixture(scope="module")
def art(compiled, tiny_ckpt):
    return compiled(tiny_ckpt, "bf16")


def bad_specs(rng: random.Random) -> list[tuple[str, str]]:
    """(SPEC, what the error must say after `--speculative: `), fresh values each run."""
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(3, 9)))
    many, low = rng.randrange(17, 1000), rng.randrange(2, 9)
    return [
        (word, f"speculative method {word!r} is unknown; choose one of prompt-lookup"),
        (f"prompt-lookup:num_tokens={many}", f"num_tokens must be 1..16 (got {many})"),
        (f"prompt-lookup:{word}=1", f"speculative option '{word}=1': expected key=value with key one of num_tokens"),
        (f"prompt-lookup:num_tokens={word}", f"speculative option num_tokens: expected an integer (got '{word}')"),
        (
            f"prompt-lookup:prompt_lookup_min={low},prompt_lookup_max={low - 1}",
            f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max (got {low}, {low - 1})",
        ),
    ]


def _run(art, prompt: str, max_tokens: int, speculative: str | None, as_json: bool) -> tuple[dict, str, str]:
    out, err = io.StringIO(), io.StringIO()
    options = RunOptions(
        str(art),
        prompt,
        max_tokens=max_tokens,
        ignore_eos=True,
        dtype="float32",
        speculative=speculative,
        as_json=as_json,
    )
    return run(options, out, err), out.getvalue(), err.getvalue()


def test_run_speculative_gives_plain_greedy_and_reports_the_drafts(art, rng):
    """Prompt lookup drafts only once a token recurs: 15 of 200 such prompts got no draft at all
    (random weights), and some drafted only tokens the model did not choose (seed 30862764: 6 drafted,
    0 accepted; 3 of 6 prompts of seed 5 at d7d6d30 accepted nothing, and at ac7551a 8 prompts in a
    row did), so up to 24 fresh prompts are tried until one has a draft accepted; each must give
    plain greedy."""
    for _ in range(24):
        phrase = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 5)))
        prompt, max_tokens = " ".join([phrase] * rng.randrange(3, 6)), rng.randrange(16, 40)
        plain, _, _ = _run(art, prompt, max_tokens, None, as_json=True)
        assert "speculative" not in plain
        spec, out, err = _run(art, prompt, max_tokens, SPEC, as_json=True)
        assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
        assert json.loads(out)["speculative"] == spec["speculative"] and err == ""
        counts = spec["speculative"]
        if counts["accepted"]:
            break
    assert 0 < counts["accepted"] <= counts["drafted"] and counts["verifications"] > 0, counts
    assert counts["acceptance_rate"] == pytest.approx(counts["accepted"] / counts["drafted"])
    assert counts["tokens_per_verification"] > 1
    _, out, err = _run(art, prompt, max_tokens, SPEC, as_json=False)
    load, summary = err.splitlines()
    assert "speculative prompt-lookup, up to 12 draft tokens" in load  # its default k
    assert f"drafts accepted {counts['accepted']}/{counts['drafted']}, " in summary
    assert f"{counts['tokens_per_verification']:.2f} tokens per verification | finish: length" in summary


def test_a_bad_spec_names_the_flag_and_the_problem(art, rng):
    cases = bad_specs(rng)
    calls = [
        (cli, [verb, art, *(["hi"] if verb == "run" else []), "--speculative", spec])
        for spec, _ in cases
        for cli in ("qruntime", "qcompile")
        for verb in ("run", "serve")
    ]
    outcomes = run_in_child(calls)
    expected = [message for _, message in cases for _ in range(4)]
    for (cli, args), message, outcome in zip(calls, expected, outcomes, strict=True):
        shown = f"{cli} {' '.join(map(str, args))}"
        assert outcome.code == 1 and outcome.out == "", (shown, outcome)
        assert outcome.err.startswith(f"error: --speculative: {message}"), (shown, outcome)
        assert len(outcome.err.strip().splitlines()) == 1 and "loaded" not in outcome.err, (shown, outcome)


def test_help_gives_the_format_the_default_and_exactness(capsys):
    texts = []
    for verb in ("run", "serve"):
        assert main([verb, "--help"]) == 0
        texts.append(capsys.readouterr().out)
    for verb in ("run", "bench"):
        result = CliRunner().invoke(qcompile_main, [verb, "--help"], terminal_width=200)
        assert result.exit_code == 0, result.output
        texts.append(result.output)
    for text in texts:
        flat = " ".join(text.split())
        assert "--speculative SPEC" in flat and "off by default" in flat, flat
        assert "METHOD[:key=value,...]" in flat and "prompt-lookup" in flat and "num_tokens" in flat
        assert "keep the model's distribution" in flat
