"""The issue's load test: 1,000 requests from 200 concurrent clients against `qruntime serve` on
loopback, a mix of streamed / whole, completions / chat, cancelled mid-stream, malformed JSON and
invalid parameters. Every valid request gets the tokens a direct Engine.generate gives (greedy, or
the same seed), every invalid one a 4xx naming its field, nothing is lost, and afterwards the
server is idle with every KV block free."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import qruntime
from qruntime import SamplingParams
from serve_harness import ROOT, ServerProcess, load_loadgen, torch_threads, wait_idle

NUM_REQUESTS = 1000
CONCURRENCY = 200
MAX_MODEL_LEN = 128
THREADS = 1  # the server's and the reference's: one op thread each, as 2 shared cores run them best
WORDS = (
    "the",
    "model",
    "runs",
    "fast",
    "and",
    "then",
    "stops",
    "here",
    "tokens",
    "cache",
    "hello",
    "world",
    "é",
    "日本",
)

# (endpoint, body change, expected status, the field the error must name)
INVALID = (
    ("completions", {"temperature": -1}, 400, "temperature"),
    ("chat", {"temperature": -0.5}, 400, "temperature"),
    ("completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"max_tokens": "8"}, 400, "max_tokens"),
    ("completions", {"n": 0}, 400, "n"),
    ("chat", {"n": 0}, 400, "n"),
    ("completions", {"model": "no-such-model"}, 404, "model"),
    ("chat", {"model": "no-such-model"}, 404, "model"),
    ("completions", {"top_p": 1.5}, 400, "top_p"),
    ("completions", {"stop": 5}, 400, "stop"),
    ("completions", {"prompt": None}, 400, "prompt"),
    ("chat", {"messages": []}, 400, "messages"),
    ("completions", {"max_tokens": 10 * MAX_MODEL_LEN}, 400, "max_tokens"),
    ("chat", {"stream": "yes"}, 400, "stream"),
    ("completions", {"logprobs": 21}, 400, "logprobs"),
    ("completions", {"seed": -3}, 400, "seed"),
)
MALFORMED = (
    b'{"prompt": "hello", "max_tokens": 4',
    b"not json at all",
    b"",
    b"[1, 2, 3]",
    b'{"prompt": "hi"}}',
    b"\xff\xfe{",
)


@dataclass(frozen=True)
class Case:
    kind: str  # valid | cancel | invalid | malformed
    prompt_ids: tuple[int, ...] = ()
    params: tuple[SamplingParams, ...] = ()  # one per choice
    expect: tuple[int, str] | None = None  # (status, param) of an invalid request


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 9)))


def _valid_body(rng: random.Random, chat: bool, tokenizer, vocab: int, model: str) -> tuple[dict, tuple[int, ...]]:
    """A request body and the prompt ids the server must derive from it."""
    if chat:
        messages = [{"role": "user", "content": _text(rng)}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": _text(rng)})
        body: dict[str, Any] = {"messages": messages}
        ids = tokenizer.encode_chat(messages)
    elif rng.random() < 0.3:
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        body = {"prompt": ids}
    else:
        text = _text(rng)
        body = {"prompt": text}
        ids = tokenizer.encode(text)
    if rng.random() < 0.5:
        body["model"] = model
    return body, tuple(ids)


def _cases(rng: random.Random, engine, model: str) -> tuple[list, list[Case]]:
    """NUM_REQUESTS (spec, case) pairs in a random order."""
    loadgen = load_loadgen()
    paths = {"completions": loadgen.COMPLETIONS, "chat": loadgen.CHAT}
    tokenizer, vocab = engine.tokenizer, engine.vocab_size
    specs, cases = [], []
    for i in range(NUM_REQUESTS):
        kind = rng.choices(("valid", "cancel", "invalid", "malformed"), weights=(74, 10, 10, 6))[0]
        chat = rng.random() < 0.45
        path = paths["chat" if chat else "completions"]
        if kind == "malformed":
            specs.append(loadgen.RequestSpec(path, raw=rng.choice(MALFORMED), tag=i))
            cases.append(Case(kind, expect=(400, None)))
            continue
        if kind == "invalid":
            endpoint, change, status, param = rng.choice(INVALID)
            body, _ = _valid_body(rng, endpoint == "chat", tokenizer, vocab, model)
            body = {k: v for k, v in {**body, "max_tokens": 4, **change}.items() if v is not None}
            specs.append(loadgen.RequestSpec(paths[endpoint], body, tag=i))
            cases.append(Case(kind, expect=(status, param)))
            continue
        body, ids = _valid_body(rng, chat, tokenizer, vocab, model)
        n = rng.choices((1, 2, 3), weights=(80, 15, 5))[0]
        sample = {"max_tokens": rng.randrange(4, 17), "temperature": 0.0}
        if kind == "cancel":
            sample = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        elif rng.random() < 0.1:  # sampled, reproducible by seed (choice j uses seed + j)
            sample.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 30))
        if kind == "valid" and rng.random() < 0.2:
            sample["stop"] = rng.choice([" t", "e", ["a", "s"], "ok"])
        if kind == "valid" and rng.random() < 0.3:
            sample["ignore_eos"] = True
        stream = kind == "cancel" or rng.random() < 0.5
        body.update(sample, n=n, stream=stream, return_token_ids=True)
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        seed = sample.get("seed")
        params = tuple(
            SamplingParams(
                max_tokens=sample["max_tokens"],
                temperature=sample["temperature"],
                top_p=sample.get("top_p", 1.0),
                seed=None if seed is None else seed + j,
                stop=sample.get("stop", ()),
                ignore_eos=sample.get("ignore_eos", False),
            )
            for j in range(n)
        )
        cancel_after = rng.randrange(1, 4) if kind == "cancel" else None
        specs.append(loadgen.RequestSpec(path, body, cancel_after=cancel_after, tag=i))
        cases.append(Case(kind, ids, params))
    return specs, cases


def _check_valid(result, case: Case, expected: dict) -> None:
    where = f"request {result.spec.tag} ({result.spec.path}, stream={result.spec.stream})"
    assert result.error is None and result.status == 200, (where, result.status, result.error, result.body)
    assert result.done or not result.spec.stream, where
    choices = result.choices()
    assert sorted(choices) == list(range(len(case.params))), (where, choices)
    total = 0
    for index, params in enumerate(case.params):
        ref = expected[(case.prompt_ids, params)]
        got = choices[index]
        assert got["token_ids"] == list(ref.token_ids), (where, index, got, ref)
        assert got["text"] == ref.text, (where, index)
        assert got["finish_reason"] == ref.finish_reason, (where, index)
        assert got["prompt_token_ids"] == list(case.prompt_ids), where
        total += len(ref.token_ids)
    if result.usage is not None:
        assert result.usage["completion_tokens"] == total and result.usage["prompt_tokens"] == len(case.prompt_ids)
    elif not result.spec.stream:
        raise AssertionError(f"{where}: a whole response without usage")


def _check_rejected(result, case: Case) -> None:
    status, param = case.expect
    where = f"request {result.spec.tag}: {result.spec.body or result.spec.raw!r}"
    assert result.error is None and result.status == status, (where, result.status, result.body, result.error)
    error = result.body["error"]
    assert set(error) == {"message", "type", "param", "code"}, where
    assert error["type"] == "invalid_request_error" and error["message"], where
    if param is None:
        assert "JSON" in error["message"], (where, error)
    else:
        assert error["param"] == param and param in error["message"], (where, error)


def test_thousand_requests_from_two_hundred_clients(tiny_ckpt, compiled, monkeypatch):
    """The clients in two processes (bench/loadgen.py's run_load_processes, as serve_bench uses it):
    each result must still come back in its spec's place."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # the client processes import loadgen from there
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    art = compiled(tiny_ckpt, "ptpc-fp8")
    engine = qruntime.load(art, "cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=1024, max_num_seqs=128)
    model = "tiny-fp8"
    specs, cases = _cases(rng, engine, model)

    server = ServerProcess(
        art,
        "--served-model-name", model,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", "192",
        "--max-num-seqs", "64",
        "--max-waiting", str(4 * NUM_REQUESTS),
        "--threads", str(THREADS),
    )  # fmt: skip
    with server:
        # the reference: every distinct (prompt, params) once, batched, with the server's thread count
        wanted = sorted({(c.prompt_ids, p) for c in cases for p in c.params}, key=repr)
        t0 = time.perf_counter()
        with torch_threads(THREADS):
            outputs = engine.generate([list(ids) for ids, _ in wanted], [p for _, p in wanted])
        expected = dict(zip(wanted, outputs, strict=True))
        print(f"reference: {len(wanted)} sequences in {time.perf_counter() - t0:.1f} s")

        started = time.perf_counter()
        results, wall, _ = load_loadgen().run_load_processes(server.url, specs, CONCURRENCY, 2, timeout=300)
        after = wait_idle(server.url)
        print(f"{NUM_REQUESTS} requests in {wall:.1f} s ({time.perf_counter() - started:.1f} s with the idle wait)")

        assert len(results) == NUM_REQUESTS  # nothing lost: one result per request
        counts = {}
        for result, case in zip(results, cases, strict=True):
            counts[case.kind] = counts.get(case.kind, 0) + 1
            if case.kind == "valid":
                _check_valid(result, case, expected)
            elif case.kind == "cancel":
                assert result.error is None and result.status == 200 and result.cancelled, (result.spec.tag, result)
            else:
                _check_rejected(result, case)
        print(counts)

        # the server is idle again: nothing running or waiting, every KV block free
        assert after["qruntime_num_requests_running"] == 0
        assert after["qruntime_num_requests_waiting"] == 0
        assert after["qruntime_kv_cache_blocks_used"] == 0
        assert after["qruntime_kv_cache_blocks_total"] == 192
        # every accepted sequence ended exactly once; the cancelled ones were aborted, not run out
        accepted = sum(len(c.params) for c in cases if c.kind in ("valid", "cancel"))
        finished = {k: v for k, v in after.items() if k.startswith("qruntime_request_success_total")}
        assert sum(finished.values()) == accepted, finished
        assert finished.get('qruntime_request_success_total{finish_reason="abort"}', 0) > 0, finished
        rejected = sum(v for k, v in after.items() if k.startswith("qruntime_requests_rejected_total"))
        assert rejected == counts.get("invalid", 0) + counts.get("malformed", 0)
        # many clients' sequences shared engine steps (continuous batching)
        assert after["qruntime_batch_size_sum"] / after["qruntime_batch_size_count"] > 4
        # TTFT / TPOT were recorded for the requests that completed
        assert after["qruntime_time_to_first_token_seconds_count"] >= counts["valid"]
        assert server.proc.poll() is None, server.stderr
    assert server.proc.returncode == 0, server.stderr
    assert "Traceback" not in server.stderr, server.stderr


@pytest.mark.parametrize("stream", [False, True])
def test_cancelled_request_is_aborted_at_once(tiny_ckpt, compiled, stream):
    """A client that goes away (a whole request timing out, or a stream closed early) frees its
    sequence's KV blocks within a step or two instead of generating to the end."""
    art = compiled(tiny_ckpt, "ptpc-fp8")
    loadgen = load_loadgen()
    body = {
        "prompt": [random.randrange(500) for _ in range(10)],
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": stream,
    }
    with ServerProcess(art, "--max-model-len", "4096", "--num-kv-blocks", "300") as server:

        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
                if stream:
                    return await loadgen.send(client, loadgen.RequestSpec(loadgen.COMPLETIONS, body, cancel_after=3))
                try:
                    await client.post(loadgen.COMPLETIONS, json=body, timeout=2.0)
                except httpx.TimeoutException:
                    return None
                raise AssertionError("4000 tokens on a CPU did not take 2 s")

        started = time.monotonic()
        result = asyncio.run(go())
        assert result is None or result.cancelled
        after = wait_idle(server.url, timeout=20)
        assert after["qruntime_kv_cache_blocks_used"] == 0 and after["qruntime_num_requests_running"] == 0
        assert after['qruntime_request_success_total{finish_reason="abort"}'] == 1
        assert after["qruntime_generation_tokens_total"] < 4000
        assert time.monotonic() - started < 30
