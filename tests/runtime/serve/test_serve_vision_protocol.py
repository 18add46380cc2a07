"""Chat requests with images to a Qwen3-VL model (ServedModel.vision set), parsed without a server:
the sequences' ids and pixel values equal what qruntime.vision.prompt_images.encode_prompt makes of
the same messages (the path Engine.chat takes); limits and malformed parts are 400s naming the part;
a prompt whose images' tokens pass max_model_len is refused before any image is decoded; prompts
given as text or ids may not hold image tokens; the parsed sequences cross the engine process's pipe
(torch's pickling) intact. The model is the tiny synthetic tokenizer's (<|image_pad|> etc. are its
Qwen special tokens) with a tiny preprocessing (patch 4, merge 2, at most 48 x 48 pixels)."""

from __future__ import annotations

import base64
import io
import multiprocessing
import random

import numpy as np
import pytest
import torch
from PIL import Image
from qruntime.serve import images as serve_images
from qruntime.serve.engine_loop import Submission, _prompt
from qruntime.serve.errors import APIError
from qruntime.serve.images import ServedVision, server_image_limits
from qruntime.serve.protocol import ServedModel, parse_chat, parse_completion
from qruntime.tokenizer import Tokenizer
from qruntime.vision.positions import VisionTokenConfig
from qruntime.vision.preprocess import VisionPreprocessConfig, preprocess_decoded
from qruntime.vision.prompt_images import MultimodalPrompt, encode_prompt

MODEL = "tiny-vl"
WORDS = ("the", "model", "runs", "fast", "hello", "world")
PREPROCESS = VisionPreprocessConfig(
    patch_size=4, merge_size=2, min_pixels=64, max_pixels=48 * 48, image_mean=(0.5,) * 3, image_std=(0.5,) * 3
)


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt) -> Tokenizer:
    return Tokenizer.from_dir(tiny_ckpt)


def _vision(tokenizer: Tokenizer, **limits) -> ServedVision:
    ids = {name: tokenizer.backend.token_to_id(f"<|{name}|>") for name in ("image_pad", "video_pad", "vision_start")}
    tokens = VisionTokenConfig(ids["image_pad"], ids["video_pad"], ids["vision_start"], 2)
    return ServedVision(tokens, PREPROCESS, server_image_limits(**limits))


def _model(tokenizer: Tokenizer, max_model_len: int = 256, **limits) -> ServedModel:
    return ServedModel(MODEL, tokenizer, 544, max_model_len, 0, 12, vision=_vision(tokenizer, **limits))


@pytest.fixture(scope="module")
def model(tokenizer) -> ServedModel:
    return _model(tokenizer)


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 5)))


def _png(rng: random.Random, width: int | None = None, height: int | None = None, fmt: str = "PNG") -> bytes:
    np_rng = np.random.default_rng(rng.randrange(1 << 32))
    width, height = width or rng.randrange(8, 80), height or rng.randrange(8, 80)
    out = io.BytesIO()
    Image.fromarray(np_rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, fmt)
    return out.getvalue()


def _part(data: bytes, media: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{base64.b64encode(data).decode()}"}}


def _messages(rng: random.Random, images: int) -> list[dict]:
    """A system message, then user messages whose parts hold `images` images at random places."""
    messages = [{"role": "system", "content": _text(rng)}]
    user = [[{"type": "text", "text": _text(rng)}] for _ in range(rng.randrange(1, 3))]
    for _ in range(images):
        parts = rng.choice(user)
        fmt = rng.choice(["PNG", "JPEG"])
        parts.insert(rng.randrange(len(parts) + 1), _part(_png(rng, fmt=fmt), f"image/{fmt.lower()}"))
    for parts in user:
        messages += [{"role": "user", "content": parts}, {"role": "assistant", "content": _text(rng)}]
    return messages[:-1]


def _error(body: dict, model: ServedModel, parse=parse_chat) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body, model)
    return info.value


@pytest.mark.parametrize("images", [0, 1, 3])
def test_ids_and_pixels_equal_encode_prompts(model, tokenizer, images, rng):
    messages = _messages(rng, images)
    add_vision_id = images == 3
    n = rng.randrange(1, 3)
    body = {"messages": messages, "n": n, "max_tokens": 4, "chat_template_kwargs": {"add_vision_id": add_vision_id}}
    request = parse_chat(body, model)
    v = model.vision
    want = encode_prompt(messages, tokenizer, v.tokens, v.preprocess, v.limits, add_vision_id=add_vision_id)
    assert len(request.sequences) == n and request.images == images
    assert request.prompt_lens == (len(want.token_ids),)
    for spec in request.sequences:
        assert list(spec.prompt_ids) == want.token_ids
        if images == 0:
            assert spec.vision is None and want.vision is None
            continue
        # decoded RGB on the HTTP side (uint8, CPU); the engine's device resizes and patchifies it
        assert all(rgb.dtype == torch.uint8 and rgb.device.type == "cpu" for rgb in spec.vision.pixels)
        preprocessed = preprocess_decoded(spec.vision, v.preprocess)
        assert torch.equal(preprocessed.pixel_values, want.vision.pixel_values)
        assert torch.equal(spec.vision.image_grid_thw, want.vision.image_grid_thw)
        assert torch.equal(preprocessed.image_grid_thw, want.vision.image_grid_thw)
        assert spec.vision.digests == want.vision.digests and len(spec.vision.digests) == images  # prefix-cache keys
    # every image's tokens are there, in a run after vision_start
    counts = (want.vision.image_grid_thw.prod(-1) // 4).tolist() if images else []
    assert request.sequences[0].prompt_ids.count(v.tokens.image_token_id) == sum(counts)
    if add_vision_id and images:
        assert "Picture 1: " in tokenizer.decode(list(request.sequences[0].prompt_ids), skip_special_tokens=False)


def test_the_engine_gets_the_ids_and_the_images(model, rng):
    request = parse_chat({"messages": _messages(rng, 2), "max_tokens": 3}, model)
    spec = request.sequences[0]
    prompt = _prompt(spec)
    assert isinstance(prompt, MultimodalPrompt)
    assert prompt.token_ids == list(spec.prompt_ids) and prompt.vision is spec.vision
    text = parse_chat({"messages": [{"role": "user", "content": _text(rng)}]}, model).sequences[0]
    assert _prompt(text) == list(text.prompt_ids)


def test_sequences_cross_the_engine_pipe_intact(model, rng):
    """The engine process's pipe pickles a Submission (multiprocessing's pickler: torch's tensors go
    through shared memory); the images arrive equal."""
    request = parse_chat({"messages": _messages(rng, 2), "n": 2, "max_tokens": 3}, model)
    sender, receiver = multiprocessing.get_context("spawn").Pipe(duplex=True)
    try:
        sender.send(("add", Submission("chatcmpl-x", request.sequences, 0.0)))
        _, got = receiver.recv()
    finally:
        sender.close()
        receiver.close()
    for before, after in zip(request.sequences, got.sequences, strict=True):
        assert after.prompt_ids == before.prompt_ids and after.params == before.params
        assert len(after.vision.pixels) == len(before.vision.pixels) == 2
        assert all(torch.equal(a, b) for a, b in zip(after.vision.pixels, before.vision.pixels, strict=True))
        assert torch.equal(after.vision.image_grid_thw, before.vision.image_grid_thw)
        assert after.vision.digests == before.vision.digests


def test_more_images_or_bytes_than_the_limits_are_400s_naming_the_part(tokenizer, rng):
    limited = _model(tokenizer, max_images=2, max_image_bytes=4096)
    small = _part(_png(rng, 8, 8))
    error = _error(
        {"messages": [{"role": "user", "content": [small, small, {"type": "text", "text": "x"}, small]}]}, limited
    )
    assert (error.status, error.param) == (400, "messages")
    assert error.message.startswith("messages[0].content[3]: more than 2 images"), error.message
    big = _part(bytes(_png(rng, 48, 48)) + bytes(4096))  # a PNG with trailing bytes: over 4096
    error = _error(
        {"messages": [{"role": "user", "content": ["hi", small]}, {"role": "user", "content": [big]}]}, limited
    )
    assert error.message.startswith("messages[0].content[0]: "), error.message  # "hi" is not a part
    error = _error(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [small, big]}]}, limited
    )
    assert error.message.startswith("messages[1].content[1]: ") and "max_image_bytes" in error.message


MALFORMED = [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,not base64!"}}, "base64 is not valid"),
    (_part(b"GIF89a but not really"), "not an image"),
    (_part(b"plain text", "text/plain"), "is not image/"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "remote image URLs are refused"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}, "local image files are not taken"),
    ({"type": "image", "image": "/etc/hostname"}, "base64"),  # never read as a path
    ({"type": "input_audio", "input_audio": {}}, "'type'"),
    (
        {"type": "video", "video": ["data:image/png;base64,AAAA"] * 4, "fps": 2},
        "video parts are not taken by the server",
    ),
]


@pytest.mark.parametrize("case", range(len(MALFORMED)))
def test_a_malformed_image_is_a_400_naming_it(model, case, rng):
    part, words = MALFORMED[case]
    parts = [_part(_png(rng)), {"type": "text", "text": _text(rng)}]
    at = rng.randrange(3)
    parts.insert(at, part)
    error = _error({"messages": [{"role": "user", "content": _text(rng)}, {"role": "user", "content": parts}]}, model)
    assert (error.status, error.param) == (400, "messages")
    assert error.message.startswith(f"messages[1].content[{at}]: ") and words in error.message, error.message
    assert "does not take images" not in error.message


def test_an_image_too_wide_is_refused_from_its_header(model, rng):
    error = _error({"messages": [{"role": "user", "content": [_part(_png(rng, 402, 2))]}]}, model)
    assert error.message.startswith("messages[0].content[0]: the image is 402x2") and "ratio" in error.message


def test_images_past_max_model_len_are_refused_before_decoding(tokenizer, rng, monkeypatch):
    """Three 48 x 48 images are 36 tokens each: with max_model_len 100 the prompt leaves no room. The
    decoding is replaced by a failure: the refusal comes first."""
    short = _model(tokenizer, max_model_len=100)

    def no_decoding(*args, **kwargs):
        raise AssertionError("images decoded before the length check")

    parts = [_part(_png(rng, 48, 48)) for _ in range(3)]
    with monkeypatch.context() as patch:
        patch.setattr(serve_images, "decode_prompt_images", no_decoding)
        error = _error({"messages": [{"role": "user", "content": parts}]}, short)
    assert (error.status, error.code) == (400, "context_length_exceeded"), error.message
    assert "with its images has" in error.message
    fits = parse_chat({"messages": [{"role": "user", "content": parts[:2]}]}, short)  # 72 image tokens fit
    assert fits.images == 2 and 72 < fits.prompt_lens[0] < 100


def test_prompts_may_not_hold_image_tokens_without_images(model, tokenizer, rng):
    image = model.vision.tokens.image_token_id
    ids = [rng.randrange(500) for _ in range(rng.randrange(2, 6))]
    at = rng.randrange(len(ids) + 1)
    error = _error({"prompt": [*ids[:at], image, *ids[at:]]}, model, parse_completion)
    assert (error.status, error.param) == (400, "prompt")
    assert f"token {image} at position {at} is an image or video token" in error.message
    error = _error({"prompt": "look: <|vision_start|><|image_pad|><|vision_end|>"}, model, parse_completion)
    assert error.param == "prompt" and "image or video token" in error.message
    error = _error({"messages": [{"role": "user", "content": f"{_text(rng)} <|image_pad|>"}]}, model)
    assert error.message.startswith("messages[0].content: the text holds <|image_pad|>"), error.message
    assert parse_completion({"prompt": ids}, model).sequences[0].prompt_ids == tuple(ids)
