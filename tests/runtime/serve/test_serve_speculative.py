"""Speculative decoding through the server: greedy completions (whole and streamed) equal the engine's
without it, on the in-thread engine and on `qruntime serve --speculative` (the engine process, its
stats crossing the pipe); /metrics counts the drafts (qruntime_spec_decode_*, the engine's own
counts), and a server that does not speculate has no such series; a bad SPEC is one `error:` line
before the port is bound or the model loads."""

from __future__ import annotations

import json
import random
import socket

import httpx
import pytest
import qruntime
from qruntime import SamplingParams
from qruntime.cli import main
from qruntime.serve.app import build_app
from serve_harness import ServerProcess, ThreadedServer, metrics, torch_threads, wait_idle

SPEC = "prompt-lookup:prompt_lookup_min=1"  # n-grams down to one token: the repetitive prompts always match
LOAD = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "num_kv_blocks": 64}  # fp32: exact greedy
COUNTERS = ("draft_tokens", "accepted_tokens", "verifications", "emitted_tokens")


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "bf16")


@pytest.fixture(scope="module")
def plain(art):
    return qruntime.load(art, **LOAD)


def repetitive(rng: random.Random, count: int) -> list[list[int]]:
    """Token-id prompts that repeat a random phrase, so prompt lookup finds matches (and the greedy output
    of random weights, which cycles, soon repeats itself too)."""
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(40) for _ in range(rng.randrange(3, 9))]
        prompts.append((phrase * 6)[: rng.randrange(10, 40)])
    return prompts


def _serve_and_compare(url: str, plain, rng: random.Random) -> int:
    """Greedy completions of fresh repetitive prompts from the server at `url` (several in one request,
    and one streamed) against `plain`'s; returns the tokens the server generated."""
    prompts, max_tokens = repetitive(rng, 4), rng.randrange(20, 40)
    body = {"model": "m", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with torch_threads(1):
        expected = plain.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    with httpx.Client(base_url=url, timeout=60) as client:
        whole = client.post("/v1/completions", json={**body, "return_token_ids": True})
        assert whole.status_code == 200, whole.text
        choices = sorted(whole.json()["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in choices] == [list(o.token_ids) for o in expected]
        assert [c["text"] for c in choices] == [o.text for o in expected]
        streamed = client.post(
            "/v1/completions", json={**body, "prompt": prompts[0], "stream": True, "return_token_ids": True}
        )
    events = [json.loads(e.removeprefix("data: ")) for e in streamed.text.strip().split("\n\n")[:-1]]
    assert sum((e["choices"][0]["token_ids"] for e in events), []) == list(expected[0].token_ids)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    return (len(prompts) + 1) * max_tokens


def _serve_until_accepted(url: str, plain, rng: random.Random) -> tuple[dict[str, float], int]:
    """`_serve_and_compare` on up to 4 fresh workloads until prompt lookup has had a draft right (about
    1 random workload in 40 has none); returns the idle server's /metrics and the tokens generated."""
    generated = 0
    for _ in range(4):
        generated += _serve_and_compare(url, plain, rng)
        m = wait_idle(url)
        if m["qruntime_spec_decode_accepted_tokens_total"] > 0:
            break
    return m, generated


def _spec_metrics(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if k.startswith("qruntime_spec_decode_")}


def _check_counts(m: dict[str, float], generated: int) -> None:
    drafted, accepted, verifications, emitted = (m[f"qruntime_spec_decode_{c}_total"] for c in COUNTERS)
    assert 0 < accepted <= drafted, m  # prompt lookup on repetitive text: some drafts right
    assert 0 < verifications < emitted <= generated, m
    assert m["qruntime_spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert m["qruntime_spec_decode_tokens_per_verification"] == pytest.approx(emitted / verifications)


def test_in_thread_engine_serves_plain_greedy_and_counts_drafts(art, plain, rng):
    engine = qruntime.load(art, **LOAD, speculative=SPEC)
    with torch_threads(1), ThreadedServer(build_app(engine, model_name="m")) as server:
        before = _spec_metrics(metrics(server.url))
        assert before == {f"qruntime_spec_decode_{c}_total": 0 for c in COUNTERS} | {
            "qruntime_spec_decode_acceptance_rate": 0,
            "qruntime_spec_decode_tokens_per_verification": 0,
        }
        m, generated = _serve_until_accepted(server.url, plain, rng)
    _check_counts(m, generated)
    s = engine.speculative_stats  # /metrics shows the engine's own counts
    assert [m[f"qruntime_spec_decode_{c}_total"] for c in COUNTERS] == [
        s.drafted,
        s.accepted,
        s.verifications,
        s.emitted,
    ]


def test_a_server_that_does_not_speculate_has_no_spec_series(plain):
    with ThreadedServer(build_app(plain, model_name="m")) as server:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert "qruntime_prefix_cache_hits_total" in text and "spec_decode" not in text


def test_serve_speculative_reaches_the_engine_process(art, plain, rng):
    """`qruntime serve --speculative`: the load line says so, outputs are plain greedy's, and the engine
    process's counts reach /metrics."""
    with ServerProcess(
        art,
        "--threads",
        "1",
        "--served-model-name",
        "m",
        "--dtype",
        "float32",
        "--speculative",
        SPEC,
        "--max-model-len",
        "128",
    ) as server:
        assert "speculative prompt-lookup, up to 12 draft tokens" in server.stderr  # the load line
        assert _spec_metrics(metrics(server.url))["qruntime_spec_decode_draft_tokens_total"] == 0
        _check_counts(*_serve_until_accepted(server.url, plain, rng))


def test_a_bad_spec_is_one_error_line_before_the_port_and_the_load(art, rng, capsys):
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(3, 9)))
    many = rng.randrange(17, 1000)
    cases = [
        (word, f"speculative method {word!r} is unknown; choose one of prompt-lookup"),
        (f"prompt-lookup:num_tokens={many}", f"num_tokens must be 1..16 (got {many})"),
        (f"prompt-lookup:{word}=1", f"speculative option '{word}=1': expected key=value with key one of num_tokens"),
        (f"prompt-lookup:num_tokens={word}", f"speculative option num_tokens: expected an integer (got '{word}')"),
    ]
    with socket.create_server(("127.0.0.1", 0)) as busy:  # an error about the port: SPEC checked too late
        port = str(busy.getsockname()[1])
        for spec, message in cases:
            assert main(["serve", str(art), "--speculative", spec, "--port", port]) == 1, spec
            err = capsys.readouterr().err
            assert err.startswith(f"error: --speculative: {message}"), (spec, err)
            assert len(err.strip().splitlines()) == 1 and "loaded" not in err
