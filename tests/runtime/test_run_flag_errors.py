"""`qruntime run` / `qcompile run`: a sampling flag's bad value is reported with the flag as typed and the
value (`--max-tokens must be ≥ 1 (got -1)`), before the model loads; the Python API (SamplingParams)
keeps naming its fields. The ranges are SamplingParams' alone: the CLI maps each field to its flag."""

from __future__ import annotations

import math
import random
from dataclasses import fields

import pytest
from cli_child import run_in_child
from qruntime.commands.run import OPTIONS, RunOptions
from qruntime.engine.sampling_params import SamplingParams


def _float(rng, low: float, high: float) -> str:
    """A random float in [low, high) as typed: its repr, which parses back to the value the error shows."""
    return repr(rng.uniform(low, high))


def bad_values(rng) -> dict[str, list[tuple[list[str], str]]]:
    """flag -> [(the arguments typed, the rule and value the error must show)], fresh values each run."""
    tokens, k, most = rng.randint(-(10**6), 0), rng.randint(-(10**6), -1), rng.randint(1, 500)
    cold, over, under = _float(rng, -100.0, -1e-6), _float(rng, 1.0 + 1e-6, 100.0), _float(rng, -100.0, 0.0)
    low_seed, high_seed = rng.randint(-(10**6), -1), (1 << 64) + rng.randrange(10**6)
    stop = "".join(rng.choice("abcxyz ") for _ in range(rng.randint(1, 8)))
    return {
        "--max-tokens": [(["--max-tokens", str(tokens)], f"must be ≥ 1 (got {tokens})")],
        "--temperature": [
            (["--temperature", cold], f"must be finite and ≥ 0 (got {cold})"),
            (["--temperature", "inf"], "must be finite and ≥ 0 (got inf)"),
            (["--temperature", "nan"], "must be finite and ≥ 0 (got nan)"),
        ],
        "--top-p": [
            (["--top-p", over], f"must be in (0, 1] (got {over})"),
            (["--top-p", under], f"must be in (0, 1] (got {under})"),
            (["--top-p", "0"], "must be in (0, 1] (got 0.0)"),
            (["--top-p", "nan"], "must be in (0, 1] (got nan)"),
        ],
        "--top-k": [(["--top-k", str(k)], f"must be ≥ 0 (got {k})")],
        "--min-p": [
            (["--min-p", over], f"must be in [0, 1] (got {over})"),
            (["--min-p", cold], f"must be in [0, 1] (got {cold})"),
            (["--min-p", "nan"], "must be in [0, 1] (got nan)"),
        ],
        "--min-tokens": [
            (["--min-tokens", str(k)], f"must be ≥ 0 (got {k})"),
            (["--min-tokens", str(most + 1), "--max-tokens", str(most)], f"must be ≤ max tokens ({most}) (got {most + 1})"),
        ],
        "--seed": [
            (["--seed", str(low_seed)], f"must be ≥ 0 and < 2**64 (got {low_seed})"),
            (["--seed", str(high_seed)], f"must be ≥ 0 and < 2**64 (got {high_seed})"),
        ],
        "--stop": [(["--stop", stop, "--stop", ""], "must be a non-empty string (got '')")],
    }


def test_every_sampling_flag_is_covered():
    """Each flag that sets a SamplingParams field (bar on/off flags, which have no bad value) has cases above."""
    sampling = {f.name for f in fields(SamplingParams)} & {f.name for f in fields(RunOptions)}
    valued = {o.flag for o in OPTIONS if o.dest in sampling and o.type is not None}
    assert valued == set(bad_values(random.Random(0)))


def test_bad_sampling_flags_name_the_flag_before_the_model_loads(compiled, tiny_ckpt, rng):
    art = compiled(tiny_ckpt, "ptpc-fp8")  # a real artifact: only the flag is wrong
    cases = [(flag, typed, rule) for flag, values in bad_values(rng).items() for typed, rule in values]
    # several bad flags at once: each is named, in SamplingParams' order of fields
    tokens = rng.randint(-50, 0)
    rules = f"must be ≥ 1 (got {tokens}); --top-p must be in (0, 1] (got 2.0)"
    cases.append(("--max-tokens", ["--top-p", "2", "--max-tokens", str(tokens)], rules))
    calls, expected = [], []
    for flag, typed, rule in cases:
        for cli in ("qruntime", "qcompile"):
            calls.append((cli, ["run", art, "hi", *typed]))
            expected.append(f"{flag} {rule}")
    for (cli, args), message, outcome in zip(calls, expected, run_in_child(calls), strict=True):
        shown = f"{cli} {' '.join(map(str, args))}"
        assert outcome.code == 1 and outcome.out == "", (shown, outcome)
        assert outcome.err == f"error: {message}\n", (shown, outcome)
        assert not outcome.torch, f"`{shown}`: torch was imported (the model began loading) before the flag's error"


@pytest.mark.parametrize("field", ["max_tokens", "temperature", "top_k", "top_p", "seed", "stop"])
def test_the_api_names_the_field(field, rng):
    bad = {
        "max_tokens": rng.randint(-100, 0),
        "temperature": -rng.uniform(1e-6, 10),
        "top_k": rng.randint(-100, -1),
        "top_p": rng.choice([0.0, math.nan, 1 + rng.uniform(1e-6, 10)]),
        "seed": rng.choice([rng.randint(-100, -1), (1 << 64) + rng.randrange(100)]),
        "stop": ("ok", ""),
    }[field]
    with pytest.raises(ValueError) as caught:
        SamplingParams(**{field: bad})
    message = str(caught.value)
    assert message.startswith(f"invalid SamplingParams: {field}") and "--" not in message
