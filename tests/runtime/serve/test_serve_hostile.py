"""The server against hostile requests, one class at a time, each with fresh random values (the seed is
printed): extreme sampling values, requests the engine fails, oversized and slow bodies, deep JSON,
strings that are not text, stop / n caps, wrong Content-Types, API keys, template errors, unexpected
exceptions, slow connections. After each: the answer names the problem (a 4xx) or the request (a
500 without the exception's text), /health is 200, a normal request is still served exactly, and
every KV block is back."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import socket
import time

import httpx
import pytest
import qruntime
import qruntime.engine.engine
from qruntime import SamplingParams
from qruntime.engine.sampling_params import SAMPLING_EPS
from qruntime.serve.app import build_app
from qruntime.serve.limits import RequestLimits
from qruntime.serve.options import ServeOptions
from qruntime.serve.server import uvicorn_config
from qruntime.tokenizer import _compile_template
from serve_harness import ThreadedServer

MODEL = "tiny-hostile"
API_KEY = "k-" + "".join(random.choices("abcdef0123456789", k=24))
LIMITS = RequestLimits(max_body_bytes=64 << 10, body_timeout=1.0)
HEADER_TIMEOUT = 1.0
POISON_SEED = 424242  # the request sampled with this seed gets NaN logits (see `served`)
RAISE_SEED = 525252  # a step sampling a request with this seed raises (see `served`)
TEMPLATE_WITH_TOOLS = (  # as Qwen3's: loops over `tools` when given
    "{%- if tools %}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


@pytest.fixture(scope="module")
def reference(art):
    return qruntime.load(art, "cpu", max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def served(art):
    """The app with an API key, small limits and the CLI's uvicorn settings; the engine's sampler
    gets NaN logits for requests seeded POISON_SEED (a model fault traced to one request)."""
    engine = qruntime.load(art, "cpu", max_model_len=256, num_kv_blocks=64)
    sample = qruntime.engine.engine.sample_on_device

    def sample_poisoning(logits, params, generators, *rest):
        if any(p.seed == RAISE_SEED for p in params):
            raise RuntimeError("a model step that fails (a bug): every sequence of its batch fails")
        logits = logits.clone()
        for row, p in enumerate(params):
            if p.seed == POISON_SEED:
                logits[row, 0] = float("nan")
        return sample(logits, params, generators, *rest)

    engine_module = qruntime.engine.engine
    engine_module.sample_on_device = sample_poisoning
    engine.tokenizer = dataclasses.replace(
        engine.tokenizer, chat_template=_compile_template(TEMPLATE_WITH_TOOLS, "test template")
    )
    app = build_app(engine, model_name=MODEL, max_waiting=32, limits=LIMITS, api_key=API_KEY)
    options = ServeOptions("unused", log_level="warning", header_timeout=HEADER_TIMEOUT)
    try:
        with ThreadedServer(app, uvicorn_config(app, options)) as server:
            yield server, app
    finally:
        engine_module.sample_on_device = sample


@pytest.fixture
def client(served):
    server, _ = served
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


def _still_serving(client, app, reference, rng) -> None:
    """/health 200, a normal request served exactly as the engine alone serves it, no KV block held."""
    assert client.get("/health").status_code == 200
    prompt = [rng.randrange(500) for _ in range(rng.randrange(2, 20))]
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert response.status_code == 200, response.text
    expected = reference.generate([prompt], SamplingParams(max_tokens=6))[0].text
    assert response.json()["choices"][0]["text"] == expected
    deadline = time.monotonic() + 10
    while app.state.engine_loop.stats().kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = app.state.engine_loop.stats()
    assert stats.alive and stats.kv_blocks_used == 0 and stats.num_running == 0


def _error(response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    for word in words:
        assert word in error["message"], error["message"]
    return error


# --- sampling values at the edges of what the validator accepts -------------------------------------
def test_extreme_sampling_values_are_served(client, served, reference, rng):
    _, app = served
    for _ in range(6):
        body = {
            "prompt": [rng.randrange(500) for _ in range(rng.randrange(2, 12))],
            "max_tokens": rng.randrange(1, 5),
            "temperature": rng.choice([5e-324, 1e-300, 1e-38, SAMPLING_EPS / 3, 1e-4, 1e30, 1.7e308]),
            "top_p": rng.choice([5e-324, 1e-300, 1e-46, 1e-9, 1.0]),
            "top_k": rng.choice([-1, 0, 1, 2, 10**30]),
            "seed": rng.randrange(1 << 62),
            "stream": rng.random() < 0.5,
        }
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, (body, response.text)
        assert '"error"' not in response.text
    _still_serving(client, app, reference, rng)


# --- a failure inside the engine that belongs to one request ----------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_engine_fails_gets_a_500_naming_it_and_the_others_run_on(
    client, served, reference, rng, stream, caplog
):
    _, app = served
    caplog.set_level(logging.ERROR)

    async def go():
        async with httpx.AsyncClient(
            base_url=client.base_url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as aclient:
            normal = [
                aclient.post(
                    "/v1/completions", json={"prompt": [rng.randrange(500) for _ in range(5)], "max_tokens": 8}
                )
                for _ in range(3)
            ]
            poisoned = aclient.post(
                "/v1/completions",
                json={"prompt": "hello there", "max_tokens": 8, "seed": POISON_SEED, "n": 2, "stream": stream},
            )
            return await asyncio.gather(poisoned, *normal)

    poisoned, *normal = asyncio.run(go())
    assert all(r.status_code == 200 for r in normal)
    if stream:
        assert poisoned.status_code == 200 and '"error"' in poisoned.text and "non-finite logits" in poisoned.text
        assert poisoned.text.endswith("data: [DONE]\n\n")
    else:
        error = _error(poisoned, 500, "failed in the engine", "non-finite logits", "server log")
        assert error["type"] == "server_error"
    assert any("non-finite" in r.getMessage() for r in caplog.records)
    _still_serving(client, app, reference, rng)


def test_a_failed_step_fails_its_requests_whole_and_the_server_runs_on(client, served, reference, rng, caplog):
    """A step that raises fails every sequence in it: a request with several choices there gets one
    500 (its other choices, ended by the same step, were once aborted again and stopped the engine loop)."""
    _, app = served
    caplog.set_level(logging.ERROR)
    n = rng.randrange(2, 5)
    body = {"prompt": [rng.randrange(500) for _ in range(4)], "max_tokens": 6, "seed": RAISE_SEED, "n": n}
    response = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    error = _error(response, 500, "failed in the engine", "the model step running this request failed", "server log")
    assert error["type"] == "server_error"
    assert any("model step" in r.getMessage() for r in caplog.records)
    _still_serving(client, app, reference, rng)


# --- size, time and shape of the body ---------------------------------------------------------------
def _read_response(sock: socket.socket) -> str:
    """One whole HTTP/1.1 response (head and a Content-Length body) read off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096) or b"\r\n\r\n"
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length"
    )
    while len(body) < length and (more := sock.recv(4096)):
        body += more
    return (head + b"\r\n\r\n" + body).decode("latin-1")


def test_an_oversized_body_is_refused_from_its_content_length_before_it_is_sent(served, client, reference, rng):
    server, app = served
    declared = LIMITS.max_body_bytes + rng.randrange(1, 1 << 40)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {declared}\r\n\r\n".encode()
        )  # and no body at all: the answer must not wait for it
        head = _read_response(sock)
    assert head.startswith("HTTP/1.1 413") and str(declared) in head
    _still_serving(client, app, reference, rng)


def test_an_oversized_streamed_body_is_refused_once_it_passes_the_cap(client, served, reference, rng):
    _, app = served

    def chunks():
        yield b'{"prompt": "'
        sent = 0
        while sent <= LIMITS.max_body_bytes:
            piece = "".join(rng.choices("abc ", k=4096)).encode()
            sent += len(piece)
            yield piece
        yield b'"}'

    response = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    _error(response, 413, "too large", str(LIMITS.max_body_bytes))
    _still_serving(client, app, reference, rng)


def test_a_body_that_does_not_arrive_in_time_gets_408(served, client, reference, rng):
    server, app = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n".encode()
            + b'{"prompt": "'
        )
        started = time.monotonic()
        head = _read_response(sock)
    assert head.startswith("HTTP/1.1 408") and time.monotonic() - started < LIMITS.body_timeout + 5
    _still_serving(client, app, reference, rng)


def _nested(depth: int, rng: random.Random) -> str:
    out = "1"
    for _ in range(depth):
        out = f"[{out}]" if rng.random() < 0.5 else f'{{"k": {out}}}'
    return out


def test_deep_json_and_strings_that_are_not_text_are_400s(client, served, reference, rng):
    _, app = served
    depth = rng.choice([LIMITS.max_json_depth + 1, 1000, 5000])  # 5000: past the recursion limit, within the body cap
    raw = f'{{"prompt": "hi", "extra": {_nested(depth, rng)}}}'
    _error(client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"}), 400, "nested")
    surrogate = f"\\u{rng.randrange(0xD800, 0xE000):04x}"
    for raw in (
        f'{{"prompt": "ab{surrogate}cd"}}',
        f'{{"prompt": "hi", "stop": ["{surrogate}"]}}',
        f'{{"messages": [{{"role": "user", "content": "x{surrogate}"}}]}}',
    ):
        path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
        error = _error(client.post(path, content=raw, headers={"Content-Type": "application/json"}), 400, "surrogate")
        assert error["code"] == "invalid_json"
    _still_serving(client, app, reference, rng)


def test_caps_on_n_and_stop(client, served, reference, rng):
    _, app = served
    cases = [
        ({"n": rng.randrange(129, 10**6)}, "n", "<= 128"),
        ({"stop": ["s"] * rng.randrange(17, 100)}, "stop", "at most 16"),
        ({"stop": ["x" * rng.randrange(4097, 20_000)]}, "stop", "characters"),
        ({"stop_token_ids": [1] * rng.randrange(1025, 3000)}, "stop_token_ids", "at most 1024"),
    ]
    for change, param, words in cases:
        error = _error(client.post("/v1/completions", json={"prompt": "hi", **change}), 400, words)
        assert error["param"] == param
    # many stop strings within the caps cost no more than the text: served as usual
    stops = ["".join(rng.choices("xyzw", k=rng.randrange(50, 250))) for _ in range(16)]
    response = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "stop": stops})
    assert response.status_code == 200
    _still_serving(client, app, reference, rng)


# --- who may send what ------------------------------------------------------------------------------
def test_posts_that_are_not_json_get_415(client, served, reference, rng):
    _, app = served
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Authorization": f"Bearer {API_KEY}"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        with httpx.Client(base_url=client.base_url, timeout=30) as bare:
            response = bare.post("/v1/completions", content=b'{"prompt": "hi"}', headers=headers)
        assert _error(response, 415, "application/json")["code"] == "unsupported_media_type"
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200  # charset parameters and the usual header are fine
    _still_serving(client, app, reference, rng)


def test_the_api_key_guards_every_v1_route_and_only_those(served, client, reference, rng):
    server, app = served
    wrong = API_KEY[:-1] + ("0" if API_KEY[-1] != "0" else "1")
    with httpx.Client(base_url=server.url, timeout=30) as bare:
        for auth in (None, f"Bearer {wrong}", f"Basic {API_KEY}", "Bearer", f"Bearer {API_KEY}x"):
            headers = {} if auth is None else {"Authorization": auth}
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
                response = bare.request(method, path, json={"prompt": "hi"}, headers=headers)
                assert _error(response, 401, "API key")["code"] == "invalid_api_key"
                assert response.headers["www-authenticate"] == "Bearer"
        assert bare.get("/health").status_code == 200 and bare.get("/metrics").status_code == 200
    assert client.get("/v1/models").status_code == 200
    _still_serving(client, app, reference, rng)


# --- errors inside the server -----------------------------------------------------------------------
def test_chat_template_errors_are_400s(client, served, reference, rng):
    _, app = served
    tools = rng.choice([5, 3.5, True])  # the template loops over tools: not iterable
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": tools}}
    error = _error(client.post("/v1/chat/completions", json=body), 400, "chat template failed")
    assert error["param"] == "messages"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"add_generation_prompt": False}}
    _error(client.post("/v1/chat/completions", json=body), 400, "add_generation_prompt")
    _still_serving(client, app, reference, rng)


def test_an_unexpected_exception_is_a_500_that_does_not_echo_it(client, served, reference, rng, caplog):
    _, app = served
    secret = f"secret-{rng.randrange(1 << 40)}"
    tokenizer = app.state.engine_loop.engine.tokenizer
    original = type(tokenizer).encode

    def encode(self, text, add_special_tokens=True):
        if text == "trigger":
            raise RuntimeError(f"{secret} /etc/shadow")
        return original(self, text, add_special_tokens)

    type(tokenizer).encode = encode
    try:
        response = client.post("/v1/completions", json={"prompt": "trigger"})
    finally:
        type(tokenizer).encode = original
    error = _error(response, 500, "internal server error", "server log")
    assert secret not in response.text and "shadow" not in response.text
    error_id = error["message"].split("(")[1].split(")")[0]
    assert any(error_id in r.getMessage() and r.exc_info and secret in str(r.exc_info[1]) for r in caplog.records)
    _still_serving(client, app, reference, rng)


# --- connections ------------------------------------------------------------------------------------
def test_slow_connections_do_not_hold_the_server(served, client, reference, rng):
    server, app = served
    socks = []
    try:
        for i in range(200):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            if i % 2:  # half send a header line and stop (slowloris), half send nothing
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(sock)
        started = time.monotonic()
        assert client.get("/health").status_code == 200
        assert time.monotonic() - started < 5
        _still_serving(client, app, reference, rng)
        time.sleep(HEADER_TIMEOUT + 0.5)
        for sock in socks:  # each closed by the server once its headers were late
            sock.settimeout(5)
            assert sock.recv(1024) == b""
    finally:
        for sock in socks:
            sock.close()
    assert client.get("/health").status_code == 200


def test_a_request_the_engine_cannot_add_fails_alone(client, served, reference, rng, caplog):
    _, app = served
    engine = app.state.engine_loop.engine
    marker = [rng.randrange(500)] * 9
    add_request = engine.add_request

    def add_or_fail(prompt, params=None, request_id=None):
        if list(prompt) == marker:
            raise KeyError("a bug reached by this prompt alone")
        return add_request(prompt, params, request_id)

    engine.add_request = add_or_fail
    try:
        response = client.post("/v1/completions", json={"prompt": marker, "max_tokens": 3, "n": 2})
    finally:
        del engine.add_request
    _error(response, 500, "failed in the engine", "server log")
    assert "bug reached" not in response.text
    assert any("could not be added" in r.getMessage() for r in caplog.records)
    _still_serving(client, app, reference, rng)
