"""Chat requests with image parts, to a server whose model is text-only (a Qwen3-VL model's are
test_serve_vision_protocol.py's and test_serve_vision_app.py's):
a 400 saying the model does not take images, and a malformed image part a 400 naming its message
and part (qruntime.vision.prompt checks it first); never a 500, and other requests unaffected.
Text-only content parts still render as the joined text. Parsing is tested without a server
(qruntime.serve.protocol), the HTTP answers on the app in a thread with the tiny artifact's engine."""

from __future__ import annotations

import base64
import io
import random
import threading

import httpx
import numpy as np
import pytest
import qruntime
from PIL import Image
from qruntime.serve.app import build_app
from qruntime.serve.errors import APIError
from qruntime.serve.protocol import ServedModel, parse_chat
from qruntime.tokenizer import Tokenizer
from serve_harness import ThreadedServer

MODEL = "tiny-text"
WORDS = ("the", "model", "runs", "fast", "hello", "world")


@pytest.fixture(scope="module")
def model(tiny_ckpt) -> ServedModel:
    return ServedModel(MODEL, Tokenizer.from_dir(tiny_ckpt), 544, 256, 0, 12)


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 5)))


def _image_url(rng: random.Random, fmt: str = "PNG") -> dict:
    np_rng = np.random.default_rng(rng.randrange(1 << 32))
    width, height = rng.randrange(4, 80), rng.randrange(4, 80)
    out = io.BytesIO()
    Image.fromarray(np_rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, fmt)
    url = f"data:image/{fmt.lower()};base64,{base64.b64encode(out.getvalue()).decode()}"
    return {"type": "image_url", "image_url": {"url": url, "detail": rng.choice(["auto", "low", "high"])}}


def _error(body: dict, model: ServedModel) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat(body, model)
    return info.value


def test_text_parts_render_as_their_joined_text(model, rng):
    texts = [_text(rng) for _ in range(rng.randrange(1, 5))]
    parts = [{"type": "text", "text": t} for t in texts]
    request = parse_chat({"messages": [{"role": "user", "content": parts}], "max_tokens": 3}, model)
    plain = [{"role": "user", "content": "".join(texts)}]
    assert request.sequences[0].prompt_ids == tuple(model.tokenizer.encode_chat(plain))


def test_images_to_a_text_only_model_are_a_400_naming_the_first(model, rng):
    messages = [{"role": "system", "content": _text(rng)}]
    first = None
    for m in range(1, rng.randrange(2, 5)):
        parts = [{"type": "text", "text": _text(rng)} for _ in range(rng.randrange(1, 4))]
        if first is None and (rng.random() < 0.5 or m == 1):
            p = rng.randrange(len(parts) + 1)
            parts.insert(p, _image_url(rng, rng.choice(["PNG", "JPEG"])))
            first = (m, p)
        for _ in range(rng.randrange(0, 3)):  # more images after the first
            parts.append(_image_url(rng))
        messages.append({"role": "user", "content": parts})
    error = _error({"messages": messages}, model)
    assert (error.status, error.param) == (400, "messages")
    assert error.message.startswith(f"messages[{first[0]}].content[{first[1]}] is an image")
    assert "this model does not take images" in error.message and MODEL in error.message


def _with(part: dict, position: int = 1) -> dict:
    parts = [{"type": "text", "text": "what is this?"}]
    parts.insert(position, part)
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": parts}]}


def _url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _b64(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


# (body, where, words): each a 400 naming the part, whatever the model
MALFORMED = [
    (_with(_url("data:image/png;base64,not base64!")), "messages[1].content[1]", "base64 is not valid"),
    (_with(_url(_b64(b"GIF89a but not really"))), "messages[1].content[1]", "not an image"),
    (_with(_url(_b64(b"plain text", "text/plain"))), "messages[1].content[1]", "is not image/"),
    (_with(_url("https://example.com/cat.png"), 0), "messages[1].content[0]", "remote image URLs are refused"),
    (_with(_url("file:///etc/hostname")), "messages[1].content[1]", "local image files are not taken"),
    (_with({"type": "image", "image": "/etc/hostname"}), "messages[1].content[1]", "base64"),  # never read as a path
    (_with({"type": "image_url"}), "messages[1].content[1]", "'url'"),
    (_with({"type": "image_url", "image_url": {"url": "data:,", "detail": "ultra"}}), "messages[1].content[1]", "detail"),
    (_with({"type": "input_audio", "input_audio": {}}), "messages[1].content[1]", "'type'"),
    ({"messages": [{"role": "assistant", "content": [_url("data:,")]}]}, "messages[0].content[0]", "user and tool"),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(MALFORMED)))
def test_a_malformed_image_part_is_a_400_naming_it(model, case):
    body, where, words = MALFORMED[case]
    error = _error(body, model)
    assert (error.status, error.param) == (400, "messages")
    assert error.message.startswith(where + ": ") and words in error.message, error.message
    assert error.message.endswith("this model does not take images: send text parts only")


def test_too_many_and_too_large_images_are_400s(model, rng):
    image = _image_url(rng)
    error = _error({"messages": [{"role": "user", "content": [image] * 17}]}, model)
    assert error.message.startswith("messages[0].content[16]: more than 16 images"), error.message
    big = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * (22 << 20)}}
    error = _error({"messages": [{"role": "user", "content": [big]}]}, model)
    assert error.message.startswith("messages[0].content[0]: ") and "max_image_bytes" in error.message


@pytest.fixture(scope="module")
def client(tiny_ckpt, compiled):
    engine = qruntime.load(compiled(tiny_ckpt, "ptpc-fp8"), "cpu", max_model_len=256, num_kv_blocks=64)
    app = build_app(engine, model_name=MODEL, max_waiting=32)
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_over_http_images_get_400s_and_text_requests_run_beside_them(client, rng):
    text = _text(rng)
    plain = {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
    expected = client.post("/v1/chat/completions", json=plain)
    assert expected.status_code == 200
    bodies = [_with(_image_url(rng)), _with(_url("data:image/png;base64,@@@")), _with(_url("http://x/y.png"))]
    answers: list[httpx.Response] = [None] * len(bodies)

    def send(i: int) -> None:
        answers[i] = client.post("/v1/chat/completions", json=bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    parts = {**plain, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    beside = client.post("/v1/chat/completions", json=parts)  # text parts, while the image requests run
    for thread in threads:
        thread.join(60)
    for answer in answers:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "messages"
        assert error["message"].startswith("messages[1].content[1]") and "does not take images" in error["message"]
    assert beside.status_code == 200
    assert beside.json()["choices"][0]["message"] == expected.json()["choices"][0]["message"]
    assert client.get("/health").json() == {"status": "ok"}
