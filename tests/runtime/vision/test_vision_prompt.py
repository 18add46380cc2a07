"""Chat messages with image parts → Qwen3-VL prompts (qruntime.vision.prompt, prompt_images), held
to transformers 5.17's Qwen3VLProcessor.

The processor is built offline: the synthetic Qwen tokenizer (qcompile.synth, which has Qwen's
vision tokens), `Qwen2VLImageProcessorPil` and transformers' `Qwen3VLVideoProcessor` (torchvision, a
test dependency: tests/torchvision_cpu.py) for the video parts. The chat template is the one
the published Qwen3-VL-30B-A3B-Instruct checkpoint ships (qwen3_vl_chat_template.jinja beside this
file), rendered by the processor from the content lists and by qruntime's Tokenizer from the
flattened strings. Images and texts are random (the `rng` fixture prints its seed).
"""

from __future__ import annotations

import base64
import copy
import io
import random
import re
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from qruntime.tokenizer import Tokenizer
from qruntime.vision import (
    IMAGE_PLACEHOLDER,
    ImageLimits,
    PromptImageError,
    VisionPreprocessConfig,
    VisionTokenConfig,
    encode_prompt,
    expand_image_tokens,
    load_prompt_images,
    probe_images,
    split_images,
)
from qruntime.vision.prompt import VIDEO_PLACEHOLDER
from qruntime.vision.video import VideoPreprocessConfig
from transformers import PreTrainedTokenizerFast, Qwen3VLProcessor, Qwen3VLVideoProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from qcompile.synth import get_preset
from qcompile.synth.tokenizer import write_tokenizer_files

TEMPLATE = Path(__file__).with_name("qwen3_vl_chat_template.jinja")
# small pixel bounds (as Qwen3-VL's otherwise) so that the images stay small and the test fast
SMALL = {
    "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64},
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
WORDS = ("look", "at", "this", "image", "what", "is", "日本", "é", " ", "\n")


VIDEO_SMALL = {**SMALL, "fps": 2, "min_frames": 4, "max_frames": 10}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl-tokenizer")
    write_tokenizer_files(get_preset("tiny").config(), root)
    (root / "chat_template.jinja").write_text(TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    tokenizer = Tokenizer.from_dir(root)
    ids = {name: tokenizer.backend.token_to_id(f"<|{name}|>") for name in ("image_pad", "video_pad", "vision_start")}
    tokens = VisionTokenConfig(
        image_token_id=ids["image_pad"], video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"]
    )
    hf = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**copy.deepcopy(SMALL)),
        tokenizer=PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json")),
        video_processor=Qwen3VLVideoProcessor(**copy.deepcopy(VIDEO_SMALL), cap_pixels_per_frame=False),
        chat_template=TEMPLATE.read_text(encoding="utf-8"),
    )
    return tokenizer, tokens, VisionPreprocessConfig.from_dict(SMALL), hf


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randrange(0, 6)))


def _noise(rng: random.Random, width: int, height: int) -> Image.Image:
    np_rng = np.random.default_rng(rng.randrange(1 << 32))
    return Image.fromarray(np_rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _image_part(rng: random.Random, image: Image.Image) -> tuple[dict, Image.Image]:
    """One image as a random kind of part, and the PIL image transformers is given for it."""
    kind = rng.choice(["data_url", "pil", "bytes", "base64", "jpeg"])
    if kind == "pil":
        return {"type": "image", "image": image}, image
    data = _encoded(image, "JPEG" if kind == "jpeg" else "PNG")
    decoded = Image.open(io.BytesIO(data))
    if kind == "bytes":
        return {"type": "image", "image": data}, decoded
    if kind == "base64":
        return {"type": "image", "image": base64.b64encode(data).decode()}, decoded
    media = "image/jpeg" if kind == "jpeg" else "image/png"
    return {"type": "image_url", "image_url": {"url": _data_url(data, media), "detail": "auto"}}, decoded


def _conversation(rng: random.Random, count: int) -> tuple[list[dict], list[dict]]:
    """Random messages holding `count` images of random sizes in user (and tool) messages: ours and
    transformers' (the same, each image part as the `image` part of a PIL image)."""
    ours = [{"role": "system", "content": _text(rng) or "be brief"}]
    theirs = [dict(ours[0])]
    left = count
    for turn in range(rng.randrange(1, 4)):
        role = "tool" if turn and rng.random() < 0.3 else "user"
        parts, hf_parts = [], []
        for _ in range(rng.randrange(1, 5)):
            if left and rng.random() < 0.6:
                part, image = _image_part(rng, _noise(rng, rng.randrange(8, 400), rng.randrange(8, 400)))
                parts.append(part)
                hf_parts.append({"type": "image", "image": image})
                left -= 1
            else:
                text = {"type": "text", "text": _text(rng)}
                parts.append(text)
                hf_parts.append(dict(text))
        ours.append({"role": role, "content": parts})
        theirs.append({"role": role, "content": hf_parts})
        ours.append({"role": "assistant", "content": _text(rng) or "ok"})
        theirs.append(dict(ours[-1]))
    while left:  # images not yet placed: a last user turn
        part, image = _image_part(rng, _noise(rng, rng.randrange(8, 400), rng.randrange(8, 400)))
        ours.append({"role": "user", "content": [part, {"type": "text", "text": "and?"}]})
        theirs.append(
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "and?"}]}
        )
        left -= 1
    return ours, theirs


@pytest.mark.parametrize("count", [0, 1, 3])
@pytest.mark.parametrize("add_vision_id", [False, True])
def test_prompt_equals_transformers_processor(setup, rng, count, add_vision_id):
    tokenizer, tokens, config, hf = setup
    ours, theirs = _conversation(rng, count)
    prompt = encode_prompt(ours, tokenizer, tokens, config, add_vision_id=add_vision_id)
    kwargs = {"add_generation_prompt": True, "add_vision_id": add_vision_id}
    # the flattened strings render through the checkpoint's template as its content lists do
    assert tokenizer.apply_chat_template(list(prompt.messages)) == hf.apply_chat_template(
        theirs, tokenize=False, **kwargs
    )
    expected = hf.apply_chat_template(theirs, tokenize=True, return_dict=True, return_tensors="pt", **kwargs)
    assert prompt.token_ids == expected["input_ids"][0].tolist()
    if count == 0:
        assert prompt.vision is None and prompt.images == ()
        assert tokens.image_token_id not in prompt.token_ids
        return
    assert torch.equal(prompt.vision.image_grid_thw, expected["image_grid_thw"])
    assert torch.equal(prompt.vision.pixel_values, expected["pixel_values"])
    # each image's run of tokens is t * h * w / merge² of its own preprocessing, in order
    ids = torch.tensor(prompt.token_ids)
    is_image = (ids == tokens.image_token_id).int()
    starts = torch.nonzero(torch.diff(is_image, prepend=torch.zeros(1, dtype=torch.int32)) == 1).flatten()
    ends = torch.nonzero(torch.diff(is_image, append=torch.zeros(1, dtype=torch.int32)) == -1).flatten()
    runs = (ends - starts + 1).tolist()
    grids = prompt.vision.image_grid_thw
    assert runs == (grids.prod(dim=1) // tokens.spatial_merge_size**2).tolist()
    assert len(runs) == count == len(prompt.images)
    assert all(ids[s - 1] == tokens.vision_start_token_id for s in starts.tolist())


@pytest.mark.parametrize("add_vision_id", [False, True])
def test_video_parts_equal_transformers_processor(setup, rng, add_vision_id):
    """Conversations with 1-2 videos (frames as arrays or PIL images, each its own rate and length)
    and 0-2 images: the template renders the same text, and the ids (timestamps and per-frame video
    tokens included), pixel_values, pixel_values_videos and both grids are the processor's."""
    tokenizer, tokens, config, hf = setup
    gen = np.random.default_rng(rng.randrange(1 << 30))
    ours, theirs, videos, images = [], [], [], []
    for _ in range(rng.randint(1, 2)):
        parts = [{"type": "text", "text": _text(rng)}]
        hf_parts = [dict(parts[0])]
        for _part in range(rng.randint(1, 2)):
            if rng.random() < 0.6 or not videos:
                count, fps = rng.randint(3, 14), rng.choice([2.0, 4.0, 6.5])
                array = gen.integers(0, 256, (count, rng.randrange(30, 90), rng.randrange(30, 90), 3), dtype=np.uint8)
                frames = [Image.fromarray(f) for f in array] if rng.random() < 0.5 else list(array)
                parts.append({"type": "video", "video": frames, "fps": fps})
                hf_parts.append({"type": "video", "video": "unused.mp4"})  # the template reads only the type
                videos.append((array, fps))
            else:
                image = _noise(rng, rng.randrange(16, 90), rng.randrange(16, 90))
                parts.append({"type": "image", "image": image})
                hf_parts.append({"type": "image", "image": image})
                images.append(image)
        ours.append({"role": "user", "content": parts})
        theirs.append({"role": "user", "content": hf_parts})
        ours.append({"role": "assistant", "content": "ok"})
        theirs.append({"role": "assistant", "content": "ok"})
    video_config = VideoPreprocessConfig.from_dict(VIDEO_SMALL)
    prompt = encode_prompt(ours, tokenizer, tokens, config, video_config=video_config, add_vision_id=add_vision_id)
    text = hf.apply_chat_template(theirs, tokenize=False, add_generation_prompt=True, add_vision_id=add_vision_id)
    assert tokenizer.apply_chat_template(list(prompt.messages)) == text
    expected = hf(
        text=[text],
        images=images or None,
        videos=[array for array, _ in videos],
        video_metadata=[{"total_num_frames": len(array), "fps": fps} for array, fps in videos],
        return_tensors="pt",
    )
    assert prompt.token_ids == expected["input_ids"][0].tolist()
    assert torch.equal(prompt.videos.pixel_values, expected["pixel_values_videos"])
    assert torch.equal(prompt.videos.video_grid_thw, expected["video_grid_thw"])
    if images:
        assert torch.equal(prompt.vision.pixel_values, expected["pixel_values"])
        assert torch.equal(prompt.vision.image_grid_thw, expected["image_grid_thw"])
    else:
        assert prompt.vision is None
    assert text.count(VIDEO_PLACEHOLDER) == len(videos) == len(prompt.videos.timestamps)


def test_video_parts_are_refused_where_videos_are_not_taken(rng):
    frames = [np.zeros((16, 16, 3), dtype=np.uint8) + rng.randrange(256) for _ in range(4)]
    messages = _user({"type": "video", "video": frames, "fps": 2.0})
    with pytest.raises(PromptImageError, match="video parts are not taken by the server") as info:
        split_images(messages)  # what the server calls
    assert (info.value.message_index, info.value.part_index) == (1, 1)
    split = split_images(messages, videos=True)
    assert split.messages[1]["content"] == "x" + VIDEO_PLACEHOLDER and len(split.videos) == 1
    for part, words in (
        ({"type": "video", "video": frames}, "'fps'"),
        ({"type": "video", "video": frames, "fps": 2.0, "speed": 2}, "a video part is"),
        ({"type": "video", "video": frames, "fps": -1}, "fps"),
    ):
        with pytest.raises(PromptImageError, match=words):
            split_images(_user(part), videos=True)


def test_placeholders_sit_where_the_parts_were(rng):
    texts = [_text(rng) for _ in range(4)]
    png = _encoded(_noise(rng, 20, 30))
    messages = [
        {"role": "system", "content": texts[0]},
        {"role": "user", "content": [{"type": "text", "text": texts[1]}, {"type": "image", "image": png}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": _data_url(png)}}], "name": "f"},
        {"role": "user", "content": [{"type": "text", "text": texts[2]}, {"type": "image", "image": png},
                                     {"type": "text", "text": texts[3]}]},
    ]  # fmt: skip
    split = split_images(messages, add_vision_id=True)
    assert [m["content"] for m in split.messages] == [
        texts[0],
        texts[1] + "Picture 1: " + IMAGE_PLACEHOLDER,
        None,
        "Picture 2: " + IMAGE_PLACEHOLDER,
        texts[2] + "Picture 3: " + IMAGE_PLACEHOLDER + texts[3],
    ]
    assert split.messages[2]["tool_calls"] == messages[2]["tool_calls"] and split.messages[3]["name"] == "f"
    assert [(i.message_index, i.part_index, i.source) for i in split.images] == [(1, 1, png), (3, 0, png), (4, 1, png)]
    assert split_images(messages).messages[4]["content"] == texts[2] + IMAGE_PLACEHOLDER + texts[3]
    assert messages[1]["content"][1]["image"] is png  # the input is not changed


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels, then a few bytes of pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))


def _user(*parts) -> list[dict]:
    return [{"role": "system", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "x"}, *parts]}]


def _url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


# (messages builder, limits (or a function of the PNG giving them), where the error points, words it must hold); builders take a PNG's bytes
REFUSED = [
    (lambda png: _user(_url("data:image/png;base64,@@@@")), {}, (1, 1), "base64 is not valid"),
    (lambda png: _user(_url("data:image/png," + "x" * 8)), {}, (1, 1), "not base64"),
    (lambda png: _user(_url(_data_url(b"hello", "text/plain"))), {}, (1, 1), "'text/plain' is not image"),
    (lambda png: _user(_url("https://example.com/cat.png")), {}, (1, 1), "remote image URLs are refused"),
    (lambda png: _user(_url("http://example.com/cat.png")), {"allow_remote_urls": True}, (1, 1), "not supported"),
    (lambda png: _user(_url("file:///etc/hostname")), {"allow_local_files": False}, (1, 1), "local image files"),
    (lambda png: _user({"type": "image", "image": "/etc/hostname"}), {"allow_local_files": False}, (1, 1), "base64"),
    (lambda png: _user(_url("/tmp/cat.png")), {}, (1, 1), "must be a data URL"),
    (lambda png: _user({"type": "image_url", "image_url": "data:,"}), {}, (1, 1), "'url'"),
    (lambda png: _user({"type": "image_url", "image_url": {"url": _data_url(png), "detail": "max"}}), {}, (1, 1), "detail"),
    (lambda png: _user({"type": "image"}), {}, (1, 1), "'image'"),
    (lambda png: _user({"type": "image", "image": 3.5}), {}, (1, 1), "got float"),
    (lambda png: _user({"type": "input_audio"}), {}, (1, 1), "'type': 'text' | 'image_url' | 'image'"),
    (lambda png: _user("just a string"), {}, (1, 1), "'type'"),
    (lambda png: _user({"type": "text", "text": 7}), {}, (1, 1), "must be a string"),
    (lambda png: _user({"type": "text", "text": "a <|image_pad|> b"}), {}, (1, 1), "<|image_pad|>"),
    (lambda png: [{"role": "user", "content": "<|video_pad|>"}], {}, (0, None), "<|video_pad|>"),
    (lambda png: [{"role": "system", "content": [{"type": "image", "image": png}]}], {}, (0, 0), "user and tool"),
    (lambda png: [{"role": "assistant", "content": [_url(_data_url(png))]}], {}, (0, 0), "'assistant'"),
    (lambda png: [{"role": "user", "content": {"text": "x"}}], {}, (0, None), "string or a list"),
    (lambda png: _user(*[{"type": "image", "image": png}] * 3), {"max_images": 2}, (1, 3), "more than 2 images"),
    (lambda png: _user({"type": "image", "image": png}), {"max_image_bytes": 50}, (1, 1), "max_image_bytes"),
    (lambda png: _user(_url(_data_url(png))), {"max_image_bytes": 50}, (1, 1), "max_image_bytes"),
    (lambda png: _user(*[{"type": "image", "image": png}] * 3), lambda png: {"max_total_bytes": 2 * len(png) + 1}, (1, 3), "max_total_bytes"),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(REFUSED)))
def test_refusals_name_the_message_and_part(rng, case):
    build, limits, (m, p), words = REFUSED[case]
    png = _encoded(_noise(rng, rng.randrange(8, 40), rng.randrange(8, 40)))
    with pytest.raises(PromptImageError) as info:
        split_images(build(png), ImageLimits(**(limits(png) if callable(limits) else limits)))
    assert (info.value.message_index, info.value.part_index) == (m, p)
    prefix = f"messages[{m}].content" + ("" if p is None else f"[{p}]") + ": "
    assert str(info.value).startswith(prefix) and words in str(info.value), str(info.value)


def test_limits_are_inclusive_and_checked(rng):
    png = _encoded(_noise(rng, 16, 16))
    three = _user(*[{"type": "image", "image": png}] * 3)
    assert len(split_images(three, ImageLimits(max_images=3, max_total_bytes=3 * len(png))).images) == 3
    assert len(split_images(_user(_url(_data_url(png))), ImageLimits(max_image_bytes=len(png))).images) == 1
    for key, bad in (("max_images", 0), ("max_image_bytes", -1), ("max_total_bytes", 1.5), ("allow_remote_urls", 1)):
        with pytest.raises(ValueError, match=key):
            ImageLimits(**{key: bad})


# (image bytes, limits, words): refused from the header, by probe_images and load_prompt_images alike
NOT_IMAGES = [
    (b"this is not an image at all", {}, "not an image"),
    (_png_header(10_000, 8_000), {"max_image_pixels": 64 << 20}, "max_image_pixels"),
    (_png_header(100_000, 100_000), {}, "pixels"),
    (_png_header(8_000, 20), {}, "ratio"),
]


@pytest.mark.parametrize("case", range(len(NOT_IMAGES)))
def test_images_are_checked_from_their_headers(setup, rng, case):
    data, limits, words = NOT_IMAGES[case]
    split = split_images(_user({"type": "image", "image": _encoded(_noise(rng, 9, 9))}, _url(_data_url(data))))
    for check in (probe_images, load_prompt_images):
        started = time.perf_counter()
        with pytest.raises(PromptImageError, match=re.escape("messages[1].content[2]: ")) as info:
            check(split, ImageLimits(**limits)) if check is probe_images else check(split, limits=ImageLimits(**limits))
        assert words in str(info.value) and time.perf_counter() - started < 2.0, str(info.value)


def test_a_truncated_image_fails_at_decoding_naming_its_part(rng):
    png = _encoded(_noise(rng, 64, 48))
    split = split_images(_user({"type": "image", "image": png[: len(png) // 2]}))
    assert probe_images(split) == [(64, 48)]  # its header is whole
    with pytest.raises(PromptImageError, match=r"^messages\[1\]\.content\[1\]: .*could not be decoded"):
        load_prompt_images(split)


def test_a_huge_base64_string_is_refused_before_it_is_decoded(monkeypatch):
    """Refused by its length: nothing base64-decodes it (was a 1 s timing, which a loaded machine missed)."""
    import qruntime.vision.prompt as prompt_module

    def never(*args, **kwargs):
        raise AssertionError("the oversized image was base64-decoded")

    monkeypatch.setattr(prompt_module.base64, "b64decode", never)
    text = "A" * (64 << 20)  # 48 MiB once decoded
    with pytest.raises(PromptImageError, match="max_image_bytes"):
        split_images(_user(_url("data:image/png;base64," + text)))


def test_expansion_checks_its_input(setup):
    _, tokens, _, _ = setup
    start, image = tokens.vision_start_token_id, tokens.image_token_id
    assert expand_image_tokens([1, start, image, 2], [[1, 4, 6]], tokens) == [1, start] + [image] * 6 + [2]
    assert expand_image_tokens(torch.tensor([start, image]), torch.tensor([[2, 2, 2]]), tokens) == [start, image, image]
    with pytest.raises(ValueError, match="1 image tokens .* for 2 images"):
        expand_image_tokens([start, image], [[1, 2, 2], [1, 2, 2]], tokens)
    with pytest.raises(ValueError, match="does not follow vision_start"):
        expand_image_tokens([start, image, image], [[1, 2, 2], [1, 2, 2]], tokens)
    with pytest.raises(ValueError, match="not a multiple of spatial_merge_size"):
        expand_image_tokens([start, image], [[1, 3, 2]], tokens)
