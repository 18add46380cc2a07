"""A Qwen3-VL model served over HTTP (tests/runtime/serve/vl_artifact.py: a tiny random checkpoint
compiled by qcompile, with a tokenizer): chat completions with data-URL images return the greedy
tokens Engine.chat gives for the same messages, with the engine on a thread of the server
(`--engine thread`) and in a process of its own (the images cross its pipe); /metrics counts the
images; a bad image is a 400 naming its part while a good request beside it runs unchanged; and
`qruntime serve`'s --max-images-per-request / --max-image-bytes reach the checks."""

from __future__ import annotations

import base64
import io
import json
import random
import threading

import httpx
import numpy as np
import pytest
import qruntime
from PIL import Image
from qruntime import SamplingParams
from qruntime.serve.app import build_app
from qruntime.serve.engine_process import EngineProcess
from serve_harness import CPU_LOAD, ServerProcess, ThreadedServer, metrics, random_text, torch_threads
from vl_artifact import compile_vl_artifact

MODEL = "tiny-vl"
MAX_IMAGES = 3


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return compile_vl_artifact(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def reference(art):
    return qruntime.load(art, **CPU_LOAD)


@pytest.fixture(scope="module")
def thread_client(art):
    """The engine on a thread of the server (what `qruntime serve --engine thread` runs)."""
    app = build_app(qruntime.load(art, **CPU_LOAD), model_name=MODEL, max_waiting=16, max_images=MAX_IMAGES)
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def process_client(art):
    """The engine in a process of its own (the server's default)."""
    engine = EngineProcess({"path": str(art), **CPU_LOAD}, max_waiting=8, threads=1)
    try:
        app = build_app(engine, model_name=MODEL)
        with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=120) as client:
            yield client
    finally:
        engine.stop(30)


def _png(rng: random.Random, width: int | None = None, height: int | None = None) -> bytes:
    pixels = np.random.default_rng(rng.randrange(1 << 32))
    width, height = width or rng.randrange(8, 64), height or rng.randrange(8, 64)
    out = io.BytesIO()
    Image.fromarray(pixels.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(data).decode()}"}}


def _messages(rng: random.Random, images: int) -> list[dict]:
    parts = [{"type": "text", "text": random_text(rng)}]
    for _ in range(images):
        parts.insert(rng.randrange(len(parts) + 1), _part(_png(rng)))
    return [{"role": "user", "content": parts}]


def _body(messages: list[dict], tokens: int, **extra) -> dict:
    return {"messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, **extra}


def _expected(reference, messages: list[dict], tokens: int, threads: int | None = None):
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    if threads is None:
        return reference.chat(messages, params)[0]
    with torch_threads(threads):
        return reference.chat(messages, params)[0]


def test_chat_with_images_returns_the_engines_greedy_tokens(thread_client, reference, rng):
    url = str(thread_client.base_url).rstrip("/")
    before = metrics(url).get("qruntime_request_images_total", 0)
    sent = 0
    for images in (0, 1, MAX_IMAGES):
        messages, tokens = _messages(rng, images), rng.randrange(3, 8)
        answer = thread_client.post("/v1/chat/completions", json=_body(messages, tokens, return_token_ids=True))
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        expected = _expected(reference, messages, tokens)
        assert choice["token_ids"] == list(expected.token_ids)
        assert choice["prompt_token_ids"] == list(expected.prompt_token_ids)
        assert choice["message"]["content"] == expected.text
        assert answer.json()["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
        sent += images
    assert metrics(url)["qruntime_request_images_total"] == before + sent


def test_images_cross_to_an_engine_process(process_client, reference, rng):
    messages, tokens = _messages(rng, 2), rng.randrange(3, 8)
    body = _body(messages, tokens, stream=True, return_token_ids=True)
    streamed = process_client.post("/v1/chat/completions", json=body)
    assert streamed.status_code == 200, streamed.text
    events = [json.loads(e.removeprefix("data: ")) for e in streamed.text.strip().split("\n\n")[:-1]]
    tokens_out = sum((e["choices"][0].get("token_ids", []) for e in events if e["choices"]), [])
    assert tokens_out == list(_expected(reference, messages, tokens, threads=1).token_ids)
    assert metrics(str(process_client.base_url).rstrip("/"))["qruntime_request_images_total"] == 2


def test_a_bad_image_is_a_400_while_a_good_request_beside_it_runs(thread_client, reference, rng):
    good_messages, tokens = _messages(rng, 1), rng.randrange(3, 8)
    truncated = _png(rng, 40, 40)
    truncated = truncated[: len(truncated) // 2]  # its header reads (the size checks pass), its pixels do not
    bad = {
        "messages[0].content[1]": [{"type": "text", "text": "a"}, _part(truncated)],
        "messages[0].content[0]": [_part(b"\x89PNG\r\n\x1a\n not really"), {"type": "text", "text": "b"}],
        "messages[0].content[3]": [_part(_png(rng, 8, 8))] * (MAX_IMAGES + 1),
        "messages[0].content[2]": [{"type": "text", "text": "c"}] * 2
        + [_part(_png(rng, 402, 2))],  # a side ratio over 200,
    }
    answers: dict[str, httpx.Response] = {}

    def send(name: str, body: dict) -> None:
        answers[name] = thread_client.post("/v1/chat/completions", json=body)

    threads = [
        threading.Thread(target=send, args=(where, {"messages": [{"role": "user", "content": parts}]}))
        for where, parts in bad.items()
    ]
    threads.append(threading.Thread(target=send, args=("good", _body(good_messages, tokens, return_token_ids=True))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for where in bad:
        assert answers[where].status_code == 400, answers[where].text
        error = answers[where].json()["error"]
        assert error["param"] == "messages" and error["message"].startswith(where + ": "), error
    good = answers["good"]
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["token_ids"] == list(_expected(reference, good_messages, tokens).token_ids)
    assert thread_client.get("/health").json() == {"status": "ok"}


def test_the_serve_commands_image_limits_hold(art, rng):
    small, large = _png(rng, 8, 8), _png(rng, 48, 48)
    with ServerProcess(art, "--max-images-per-request", "2", "--max-image-bytes", str(len(large) - 1)) as server:
        post = lambda parts: httpx.post(  # noqa: E731
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": parts}], "max_tokens": 2},
            timeout=120,
        )
        answer = post([_part(small), {"type": "text", "text": "x"}, _part(small)])
        assert answer.status_code == 200, answer.text
        answer = post([_part(small)] * 3)
        assert answer.status_code == 400 and "messages[0].content[2]: more than 2 images" in answer.text
        answer = post([_part(large)])
        assert answer.status_code == 400 and "max_image_bytes" in answer.text
        assert answer.json()["error"]["message"].startswith("messages[0].content[0]: ")
