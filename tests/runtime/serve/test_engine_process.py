"""The engine in a process of its own (qruntime serve's default): served outputs equal the engine's
own, its metrics and stats reach the HTTP side, admission is bounded there, a load error is the
engine's own exception, and a dead engine process fails the requests in flight and then /health,
while stop() leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from multiprocessing import resource_tracker

import httpx
import pytest
import qruntime
from qruntime import SamplingParams
from qruntime.artifact import ArtifactFormatError
from qruntime.serve.app import build_app
from qruntime.serve.engine_loop import QueueFull
from qruntime.serve.engine_process import EngineProcess
from qruntime.serve.protocol import SequenceSpec
from serve_harness import CPU_LOAD, ThreadedServer, metrics, random_text, torch_threads


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


@pytest.fixture(scope="module")
def reference(art):
    return qruntime.load(art, **CPU_LOAD)


@pytest.fixture(scope="module")
def process(art):
    engine = EngineProcess({"path": str(art), **CPU_LOAD}, max_waiting=8, threads=1)
    yield engine
    engine.stop(30)


@pytest.fixture(scope="module")
def client(process):
    app = build_app(process, model_name="tiny")
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_served_outputs_equal_the_engines_own(client, process, reference, rng):
    prompts = [random_text(rng) for _ in range(3)]
    tokens = rng.randrange(3, 12)
    body = {"prompt": prompts, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "model": "tiny"}
    whole = client.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    streamed = client.post("/v1/completions", json={**body, "stream": True, "return_token_ids": True})
    with torch_threads(1):
        expected = reference.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    assert [c["text"] for c in whole.json()["choices"]] == [o.text for o in expected]
    events = [json.loads(e.removeprefix("data: ")) for e in streamed.text.strip().split("\n\n")[:-1]]
    for index, out in enumerate(expected):
        chunks = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in chunks) == out.text
        assert sum((c["token_ids"] for c in chunks), []) == list(out.token_ids)
        assert chunks[-1]["finish_reason"] == "length"
    # what the engine process counted reached this side's metrics and stats
    m = metrics(str(client.base_url).rstrip("/"))
    assert m["qruntime_generation_tokens_total"] >= 2 * len(prompts) * tokens
    assert m["qruntime_prefix_cache_queries_total"] > 0 and m["qruntime_engine_alive"] == 1
    stats = process.stats()
    assert (stats.num_waiting, stats.num_running, stats.kv_blocks_used) == (0, 0, 0) and stats.alive
    assert stats.kv_blocks_total == 64 and process.description["device"] == "cpu"


def test_the_tokenizer_crossed_over_whole(client, process, reference, rng):
    """The HTTP side renders chats and counts prompt tokens with the tokenizer the engine process sent."""
    messages = [{"role": "user", "content": random_text(rng)}]
    response = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    ).json()
    (expected,) = reference.chat(messages, SamplingParams(max_tokens=4))
    assert response["choices"][0]["prompt_token_ids"] == list(expected.prompt_token_ids)
    assert response["choices"][0]["token_ids"] == list(expected.token_ids)


def test_admission_is_bounded_on_the_http_side(process, rng, monkeypatch):
    """max_waiting counts what was sent and not yet taken by the engine process, plus its waiting.
    The burst's message is held on this side until the second submit has been refused: sent, it
    could be taken (and its sequences admitted to running) before the second submit, which CI's
    loaded machine once did (no QueueFull)."""

    async def main() -> None:
        spec = lambda i: SequenceSpec(i, 0, (1, 2, 3), SamplingParams(max_tokens=64, ignore_eos=True))  # noqa: E731
        burst = tuple(spec(i) for i in range(process.max_waiting))
        held: list[tuple] = []
        monkeypatch.setattr(process, "_command", held.append)
        first = process.submit("burst-a", burst)  # fits exactly; the engine has not taken it
        with pytest.raises(QueueFull):
            process.submit("burst-b", (spec(0),))
        monkeypatch.undo()
        assert [message[0] for message in held] == ["add"]
        process._command(held[0])  # now the engine process takes it
        first.close()
        deadline = time.monotonic() + 30
        while process.stats().num_running + process.stats().num_waiting and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert process.stats().kv_blocks_used == 0

    asyncio.run(main())


def test_a_load_error_is_the_engines_own_and_leaves_no_process(tmp_path):
    (tmp_path / "manifest.json").write_text('{"format": "junk"')
    # multiprocessing's resource tracker, started by the first spawn of this test process, lives on by
    # design (it is not the engine's): started first, so that a run where this test spawns first passes
    resource_tracker.ensure_running()
    children_before = _children()
    with pytest.raises(ArtifactFormatError, match="manifest.json"):
        EngineProcess({"path": str(tmp_path), **CPU_LOAD}, max_waiting=4)
    assert _children() == children_before


def test_a_dead_engine_process_fails_requests_in_flight_then_health(art, rng):
    engine = EngineProcess({"path": str(art), **CPU_LOAD}, max_waiting=8, threads=1)
    app = build_app(engine, model_name="tiny")
    try:
        with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
            assert client.get("/health").status_code == 200
            body = {"prompt": random_text(rng), "max_tokens": 200, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # it is generating
                os.kill(engine._process.pid, signal.SIGKILL)
                rest = "\n".join(lines)
            assert '"error"' in rest and "the engine failed" in rest and rest.strip().endswith("data: [DONE]")
            assert client.get("/health").status_code == 503
            refused = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
            assert refused.status_code == 503 and "restarted" in refused.json()["error"]["message"]
    finally:
        engine.stop(10)
    assert not engine._process.is_alive()


def test_stop_ends_the_engine_process(art):
    engine = EngineProcess({"path": str(art), **CPU_LOAD}, max_waiting=4, threads=1)
    pid = engine._process.pid
    assert pid in _children()
    engine.stop(30)
    assert engine._process.exitcode == 0 and pid not in _children() and not engine.alive
    engine.stop(30)  # idempotent


def _children() -> set[int]:
    """This process's live children (from /proc)."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) == me and fields[0] != "Z":
                found.add(int(entry))
    return found


def _stop_case(reference, rng):
    """A prompt and a stop string that ends its greedy reply mid-way (found in the engine's own text)."""
    for _ in range(20):
        prompt = random_text(rng)
        with torch_threads(1):
            (free,) = reference.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))
        text = free.text
        if len(text) < 12:
            continue
        at = rng.randrange(4, len(text) - 6)
        stop = text[at : at + rng.randrange(1, 4)]
        params = SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,))
        with torch_threads(1):
            (expected,) = reference.generate([prompt], params)
        if expected.finish_reason == "stop" and 0 < len(expected.token_ids) < 40:
            return prompt, stop, expected
    pytest.fail("no reply of the tiny model was long enough to cut with a stop string")


def test_stop_strings_end_sequences_as_the_engine_does(client, process, reference, rng):
    """The engine process sends ids; the HTTP side turns them into text and applies stop strings: the
    text, the tokens (none after the one completing the stop string), finish and stop reasons equal
    the engine's own, whole and streamed, for each of n choices; the sequences end in the engine too."""
    prompt, stop, expected = _stop_case(reference, rng)
    print("stop", repr(stop), "after", len(expected.token_ids), "tokens")
    before = metrics(str(client.base_url).rstrip("/")).get('qruntime_request_success_total{finish_reason="stop"}', 0)
    n = rng.randrange(1, 4)
    # room past the stop (found within 40 tokens): the engine runs ahead of the HTTP side, and with
    # max_tokens 40 a stop completed at token 39 found the sequence already ended by length there
    # (torch seed 1851374545, rng seed 44516116), counted as such
    body = {
        "prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stop": [stop], "n": n,
        "return_token_ids": True, "model": "tiny",
    }  # fmt: skip
    whole = client.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    streamed = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(e.removeprefix("data: ")) for e in streamed.text.strip().split("\n\n")[:-1]]
    assert len(whole.json()["choices"]) == n
    for choice in whole.json()["choices"]:
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (expected.text, "stop", stop)
        assert choice["token_ids"] == list(expected.token_ids)
    assert whole.json()["usage"]["completion_tokens"] == n * len(expected.token_ids)
    for index in range(n):
        chunks = [c for e in events for c in e["choices"] if c["index"] == index]
        assert "".join(c["text"] for c in chunks) == expected.text
        assert sum((c.get("token_ids") or [] for c in chunks), []) == list(expected.token_ids)
        assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", stop)
    assert events[-1]["usage"]["completion_tokens"] == n * len(expected.token_ids)
    # ended in the engine as well, and counted there as stopped, not aborted
    deadline = time.monotonic() + 30
    while process.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.stats().num_running == 0 and process.stats().kv_blocks_used == 0
    after = metrics(str(client.base_url).rstrip("/"))
    assert after['qruntime_request_success_total{finish_reason="stop"}'] - before == 2 * n
