"""The ASGI app on uvicorn in a thread (a real engine on the tiny artifact, plain httpx): response
shapes of every route, streamed and whole outputs equal to the engine's own, OpenAI error JSON for
bad bodies, unknown routes and methods, and an engine failure that fails requests instead of
hanging them."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import qruntime
from qruntime import SamplingParams
from qruntime.serve.app import build_app
from serve_harness import ThreadedServer

WORDS = ("the", "model", "runs", "fast", "hello", "world", "cache", "tokens")
MODEL = "tiny-served"


def _text() -> str:
    return " ".join(random.choice(WORDS) for _ in range(random.randrange(2, 7)))


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


@pytest.fixture(scope="module")
def reference(art):
    """A second engine for expected outputs (the served one belongs to the server's thread)."""
    return qruntime.load(art, "cpu", max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def client(art):
    engine = qruntime.load(art, "cpu", max_model_len=256, num_kv_blocks=64)
    app = build_app(engine, model_name=MODEL, max_waiting=32)
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _events(response) -> list[str]:
    """The data fields of an SSE body, checking its framing (every event `data: ...` + a blank line)."""
    body = response.text
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), body
    return [e.removeprefix("data: ") for e in events]


def test_models_health_and_metrics(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 256
    assert client.get("/health").json() == {"status": "ok"}
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in (
        "qruntime_num_requests_waiting", "qruntime_num_requests_running", "qruntime_kv_cache_blocks_used",
        "qruntime_kv_cache_blocks_total 64.0", "qruntime_time_to_first_token_seconds_bucket",
        "qruntime_time_per_output_token_seconds_bucket", "qruntime_generation_tokens_total",
        "qruntime_generation_tokens_per_second",
    ):  # fmt: skip
        assert name in metrics.text, name


def test_completion_matches_the_engine(client, reference):
    prompts = [_text(), _text()]
    response = client.post(
        "/v1/completions", json={"prompt": prompts, "max_tokens": 7, "temperature": 0, "n": 2, "model": MODEL}
    )
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    expected = reference.generate(prompts, SamplingParams(max_tokens=7))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for choice in body["choices"]:
        out = expected[choice["index"] // 2]
        assert choice["text"] == out.text and choice["finish_reason"] == out.finish_reason
        assert choice["logprobs"] is None and "token_ids" not in choice
    completion_tokens = 2 * sum(len(o.token_ids) for o in expected)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in expected)
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]  # exact in test_serve_prefix_cache.py
    assert isinstance(cached, int) and 0 <= cached <= prompt_tokens
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def test_chat_matches_the_engine(client, reference):
    messages = [{"role": "user", "content": _text()}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    response = client.post("/v1/chat/completions", json=body).json()
    (expected,) = reference.chat(messages, SamplingParams(max_tokens=6))
    assert response["id"].startswith("chatcmpl-") and response["object"] == "chat.completion"
    (choice,) = response["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert choice["token_ids"] == list(expected.token_ids)
    assert choice["prompt_token_ids"] == list(expected.prompt_token_ids)


def test_streamed_completion(client, reference):
    prompt = _text()
    body = {"prompt": prompt, "max_tokens": 9, "temperature": 0, "ignore_eos": True, "stream": True}
    response = client.post(
        "/v1/completions", json={**body, "stream_options": {"include_usage": True}, "return_token_ids": True}
    )
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = _events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *choices, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    (expected,) = reference.generate(prompt, SamplingParams(max_tokens=9, ignore_eos=True))
    assert "".join(c["choices"][0]["text"] for c in choices) == expected.text
    assert sum((c["choices"][0]["token_ids"] for c in choices), []) == list(expected.token_ids)
    assert [c["choices"][0]["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]


def test_streamed_chat(client, reference):
    messages = [{"role": "user", "content": _text()}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "stream": True, "n": 2}
    events = _events(client.post("/v1/chat/completions", json=body))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    (expected,) = reference.chat(messages, SamplingParams(max_tokens=5))
    for index in (0, 1):
        deltas = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(d["delta"].get("content", "") for d in deltas) == expected.text
        assert deltas[-1]["finish_reason"] == expected.finish_reason


def test_malformed_bodies_unknown_routes_and_methods_get_openai_errors(client):
    for raw in (b"{", b"nope", b"", b"\xff"):
        response = client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert response.status_code == 400
        error = response.json()["error"]
        assert (
            error["type"] == "invalid_request_error" and error["code"] == "invalid_json" and "JSON" in error["message"]
        )
    response = client.post("/v1/chat/completions", json=[{"role": "user", "content": "hi"}])
    assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"]
    response = client.post("/v1/completions", json={"prompt": "hi", "model": "other"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    response = client.get("/v1/nothing-here")
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    response = client.get("/v1/completions")
    assert response.status_code == 405 and response.json()["error"]["message"]
    response = client.post("/v1/completions", json={"prompt": "hi", "n": 33})  # more than --max-waiting at once
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    assert "33 sequences" in response.json()["error"]["message"]


def test_an_engine_failure_fails_requests_and_health(art, caplog):
    """A failure of the engine itself (a device error: no step can run after it) fails every request
    and /health; the responses do not echo the exception, the log has it."""
    engine = qruntime.load(art, "cpu", max_model_len=64, num_kv_blocks=16)

    def broken_step():
        raise RuntimeError("device lost")

    engine.step = broken_step  # the loop's next step fails
    with ThreadedServer(build_app(engine, model_name=MODEL)) as server, httpx.Client(base_url=server.url) as client:
        response = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        error = response.json()["error"]
        assert response.status_code == 500 and error["type"] == "server_error"
        assert "device lost" not in error["message"] and "server log" in error["message"]
        assert client.get("/health").status_code == 503
        response = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert response.status_code == 503 and "must be restarted" in response.json()["error"]["message"]
        assert "device lost" not in response.text
        assert "qruntime_engine_alive 0.0" in client.get("/metrics").text
    assert any("device lost" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


def test_text_chars_counts_what_a_parse_would_tokenize():
    from qruntime.serve.app import _text_chars

    rng = random.Random()
    ids = [rng.randrange(1000) for _ in range(rng.randrange(100, 3000))]
    assert _text_chars({"prompt": ids, "max_tokens": 5, "temperature": 0.5}, 100) == len("prompt max_tokens temperature") - 2
    words = _text()
    body = {"messages": [{"role": "user", "content": words}], "stop": ["a", "bc"]}
    assert _text_chars(body, 10_000) == len("messages" "role" "user" "content" "stop" "a" "bc") + len(words)
    assert 100 < _text_chars({"prompt": ["x" * 60] * 1000}, 100) <= 160  # stops once past the limit


def test_requests_with_little_text_are_parsed_in_place(client, reference, monkeypatch):
    from qruntime.serve import app as app_module

    handed_over = []
    run_sync = app_module.anyio.to_thread.run_sync

    async def counting(fn, *args, **kwargs):
        handed_over.append(fn.__name__)
        return await run_sync(fn, *args, **kwargs)

    monkeypatch.setattr(app_module.anyio.to_thread, "run_sync", counting)
    rng = random.Random()
    ids = [rng.randrange(200) for _ in range(rng.randrange(100, 200))]
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "model": MODEL}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200 and handed_over == []
    expected = reference.generate([ids], SamplingParams(max_tokens=3, temperature=0))[0]
    assert response.json()["choices"][0]["text"] == expected.text
    long_text = " ".join(rng.choice(WORDS) for _ in range(app_module.INLINE_PARSE_CHARS // 3))
    response = client.post("/v1/completions", json={"prompt": long_text, "max_tokens": 1, "model": MODEL})
    assert handed_over == ["parse_completion"]  # its tokenizing ran on a worker thread
    assert response.status_code in (200, 400) and (response.status_code == 200 or "max_model_len" in response.text)


def test_logit_bias_min_p_and_min_tokens_reach_the_engine(client, reference):
    rng = random.Random()
    ids = [rng.randrange(200) for _ in range(rng.randrange(3, 30))]
    forced, least = rng.randrange(200), rng.randrange(1, 5)
    body = {
        "prompt": ids, "max_tokens": 6, "temperature": 0, "model": MODEL, "logit_bias": {str(forced): 100},
        "min_p": 0.2, "min_tokens": least, "stop_token_ids": [forced], "return_token_ids": True,
    }  # fmt: skip
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    params = SamplingParams(
        max_tokens=6, logit_bias={forced: 100.0}, min_p=0.2, min_tokens=least, stop_token_ids=(forced,)
    )
    expected = reference.generate([ids], params)[0]
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == list(expected.token_ids) and choice["text"] == expected.text
    # the forced token is held back until min_tokens, then ends the generation at once
    assert len(expected.token_ids) == least + 1 and expected.token_ids[-1] == forced


def test_penalties_reach_the_engine(client, reference):
    rng = random.Random()
    ids = [rng.randrange(200) for _ in range(rng.randrange(3, 30))]
    penalties = {"presence_penalty": rng.uniform(0.5, 2), "frequency_penalty": rng.uniform(0.5, 2),
                 "repetition_penalty": rng.uniform(2, 20)}  # fmt: skip
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "model": MODEL, **penalties}
    response = client.post("/v1/completions", json={**body, "return_token_ids": True})
    assert response.status_code == 200, response.text
    expected = reference.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True, **penalties))[0]
    assert response.json()["choices"][0]["token_ids"] == list(expected.token_ids)
