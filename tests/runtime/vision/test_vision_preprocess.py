"""Qwen3-VL image preprocessing (qruntime.vision) against transformers 5.17's own image processor.

The reference is `Qwen2VLImageProcessorPil`, the processor transformers builds for a Qwen3-VL
checkpoint when torchvision is absent (as here), built from a config dict (no hub). Its resize is
Pillow's BICUBIC and its arithmetic numpy's; ours reproduces both, so pixel_values are compared for
exact equality (no tolerance) and image_grid_thw too. transformers' torchvision backend (not
installed here) resizes with torch's own antialiased bicubic instead, which differs from Pillow
(resample.py gives the measured sizes); we follow Pillow.

Images are random (fresh seed per run, printed by the `rng` fixture): noise, the worst case for
rounding, at tiny, ordinary, large and extreme-aspect sizes, in RGB, RGBA, L, P and CMYK modes.
"""

from __future__ import annotations

import base64
import copy
import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from qruntime.vision import (
    QWEN3_VL,
    DecodedImages,
    ImageInputError,
    VisionPreprocessConfig,
    decode_images,
    load_image,
    preprocess_decoded,
    preprocess_images,
    smart_resize,
)
from qruntime.vision.resample import resize_bicubic
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

# preprocessor_config.json of the published Qwen3-VL checkpoints (the keys the image processor reads)
QWEN3_VL_JSON = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
# non-default: top-level min/max_pixels overriding `size`, other patch / merge / mean / rescale settings
SMALL_JSON = {
    **QWEN3_VL_JSON,
    "min_pixels": 32 * 32 * 8,
    "max_pixels": 32 * 32 * 120,
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 3,
    "image_mean": [0.4, 0.45, 0.5],
    "image_std": [0.2, 0.25, 0.3],
    "rescale_factor": 0.004,
}
CLIP_DEFAULTS_JSON = {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}}  # transformers' defaults
CONFIGS = {"qwen3-vl": QWEN3_VL_JSON, "small": SMALL_JSON, "clip-defaults": CLIP_DEFAULTS_JSON}


def hf_processor(config: dict) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(**copy.deepcopy(config))  # it mutates the size dict it is given


def noise(np_rng: np.random.Generator, width: int, height: int, mode: str = "RGB") -> Image.Image:
    rgba = Image.fromarray(np_rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    return rgba if mode == "RGBA" else rgba.convert(mode)


def assert_same(ours, theirs) -> None:
    assert torch.equal(ours.image_grid_thw, theirs["image_grid_thw"]), (ours.image_grid_thw, theirs["image_grid_thw"])
    assert ours.pixel_values.dtype == theirs["pixel_values"].dtype == torch.float32
    assert ours.pixel_values.shape == theirs["pixel_values"].shape
    diff = (ours.pixel_values - theirs["pixel_values"]).abs().max().item()
    assert torch.equal(ours.pixel_values, theirs["pixel_values"]), f"max difference {diff}"


def test_config_from_dict_reads_keys_as_transformers_does():
    assert VisionPreprocessConfig.from_dict(QWEN3_VL_JSON) == QWEN3_VL
    assert VisionPreprocessConfig.from_dict({}) == VisionPreprocessConfig()
    small = VisionPreprocessConfig.from_dict(SMALL_JSON)
    assert (small.min_pixels, small.max_pixels, small.temporal_patch_size) == (32 * 32 * 8, 32 * 32 * 120, 3)
    for config in CONFIGS.values():  # our reading of the pixel bounds is transformers'
        hf = hf_processor(config)
        ours = VisionPreprocessConfig.from_dict(config)
        assert (ours.min_pixels, ours.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"])
        assert (ours.patch_size, ours.merge_size, ours.rescale_factor) == (
            hf.patch_size,
            hf.merge_size,
            hf.rescale_factor,
        )
    with pytest.raises(ValueError, match="size.longest_edge"):
        VisionPreprocessConfig.from_dict({"size": {"shortest_edge": 100}})
    with pytest.raises(ValueError, match="resample"):
        VisionPreprocessConfig.from_dict({"resample": 2})
    with pytest.raises(ValueError, match="image_mean"):
        VisionPreprocessConfig.from_dict({"image_mean": [0.5, 0.5]})


def test_smart_resize_equals_transformers(rng):
    for _ in range(3000):
        height, width = rng.randint(1, 9000), rng.randint(1, 9000)
        factor = rng.choice([28, 32, 56])
        lo = rng.choice([56 * 56, 65536, 32 * 32 * 8])
        hi = rng.choice([28 * 28 * 1280, 16777216, 32 * 32 * 120])
        try:
            expected = hf_smart_resize(height, width, factor, lo, hi)
        except ValueError:
            with pytest.raises(ImageInputError, match="aspect ratio"):
                smart_resize(height, width, factor, lo, hi)
            continue
        assert smart_resize(height, width, factor, lo, hi) == expected, (height, width, factor, lo, hi)


def test_resize_equals_pillow_bicubic(rng):
    """Both pass orders Pillow 13 picks between, up- and downscaling, 1-pixel sides included."""
    np_rng = np.random.default_rng(rng.randrange(1 << 32))
    for _ in range(100):
        height, width = rng.randint(1, 120), rng.randint(1, 120)
        out_h, out_w = rng.randint(1, 150), rng.randint(1, 150)
        pixels = np_rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        expected = np.asarray(Image.fromarray(pixels).resize((out_w, out_h), Image.Resampling.BICUBIC))
        got = resize_bicubic(torch.from_numpy(pixels).permute(2, 0, 1), out_h, out_w).permute(1, 2, 0).numpy()
        assert np.array_equal(got, expected), (height, width, out_h, out_w)


def _sizes(rng) -> list[tuple[int, int]]:
    return [
        (1, 1),
        (rng.randint(2, 12), rng.randint(2, 12)),  # tiny: scaled up to min_pixels
        (rng.randint(100, 700), rng.randint(100, 700)),
        (rng.randint(700, 1600), rng.randint(300, 900)),
        (rng.randint(1500, 1900), rng.randint(1100, 1400)),  # large: 2-3 MP
        (rng.randint(5000, 7000), 31),  # ~200:1, near transformers' limit
        (29, rng.randint(5000, 5800)),
    ]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pixel_values_equal_transformers(name, rng):
    config = CONFIGS[name]
    np_rng = np.random.default_rng(rng.randrange(1 << 32))
    ours_config, hf = VisionPreprocessConfig.from_dict(config), hf_processor(config)
    modes = ["RGB", "RGBA", "L", "P", "CMYK"]
    images = []
    for width, height in _sizes(rng):
        if max(width, height) / min(width, height) > 200:
            continue
        images.append(noise(np_rng, width, height, rng.choice(modes)))
    for image in images:  # one at a time: a failure names the image
        ours = preprocess_images([image], ours_config)
        assert_same(ours, hf(images=[image], return_tensors="pt"))
    # a batch: concatenated in order, as transformers does
    batch = images[:4]
    assert_same(preprocess_images(batch, ours_config), hf(images=batch, return_tensors="pt"))


def _encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_each_input_kind_equals_transformers(fmt, rng, tmp_path):
    """PIL image, Path, path string, bytes, base64 and data URL: the same patches as transformers
    given the same image (transformers' processor takes the path, base64 and data URL strings too)."""
    np_rng = np.random.default_rng(rng.randrange(1 << 32))
    image = noise(np_rng, rng.randint(40, 900), rng.randint(40, 900), "RGB")
    data = _encoded(image, fmt)
    path = tmp_path / f"image.{fmt.lower()}"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    url = f"data:image/{fmt.lower()};base64,{b64}"
    hf = hf_processor(QWEN3_VL_JSON)
    expected = hf(images=[str(path)], return_tensors="pt")
    for source, theirs in [
        (Image.open(io.BytesIO(data)), Image.open(io.BytesIO(data))),
        (path, str(path)),
        (str(path), str(path)),
        (data, Image.open(io.BytesIO(data))),
        (b64, b64),
        (url, url),
    ]:
        assert_same(preprocess_images([source]), hf(images=[theirs], return_tensors="pt"))
        assert_same(preprocess_images([source]), expected)


def test_exif_orientation_applied_as_transformers_does(rng, tmp_path):
    np_rng = np.random.default_rng(rng.randrange(1 << 32))
    image = noise(np_rng, 300, 120, "RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: upright it is 120 wide, 300 high
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif)
    assert load_image(path).size == (120, 300)
    assert_same(preprocess_images([path]), hf_processor(QWEN3_VL_JSON)(images=[str(path)], return_tensors="pt"))


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels, followed by a few bytes of pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))


def test_hostile_inputs_refused_with_clear_errors(rng):
    np_rng = np.random.default_rng(rng.randrange(1 << 32))
    png = _encoded(noise(np_rng, 64, 48), "PNG")
    cases = [
        (b"this is not an image at all", "image bytes .* is not an image"),
        (png[: len(png) // 2], "could not be decoded"),
        (_png_header(10_000, 8_000), "over the limit"),  # refused from the header: there are no pixels to decode
        (_png_header(100_000, 100_000), "too many pixels|over the limit"),
        ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "media type 'text/plain' is not an image"),
        ("data:image/png," + "x" * 10, "not base64"),
        ("data:image/png;base64", "no ','"),
        ("https://example.com/cat.png", "remote image URLs are not fetched"),
        ("not a file and not base64!", "neither an existing file, a data URL, nor valid base64"),
        (base64.b64encode(b"GIF89a but not really").decode(), "base64 image .* is not an image"),
        (12345, "got int"),
        (Path("/nonexistent/dir/image.png"), "could not be read"),
    ]
    for source, message in cases:
        with pytest.raises(ImageInputError, match=message):
            preprocess_images([source])
    with pytest.raises(ImageInputError, match="64x48 = 3,072 pixels, over the limit of 1,000"):
        preprocess_images([png], max_image_pixels=1000)
    with pytest.raises(ImageInputError, match="aspect ratio"):
        preprocess_images([noise(np_rng, 402, 2)])
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"
    with pytest.raises(ImageInputError, match="is not an image"):  # EPS would run Ghostscript: not opened
        load_image(eps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_equals_cpu(rng):
    np_rng = np.random.default_rng(rng.randrange(1 << 32))
    images = [noise(np_rng, rng.randint(30, 3000), rng.randint(30, 3000)) for _ in range(6)]
    for config in (QWEN3_VL, VisionPreprocessConfig.from_dict(SMALL_JSON)):
        cpu = preprocess_images(images, config)
        gpu = preprocess_images(images, config, device="cuda")
        assert gpu.pixel_values.is_cuda
        assert torch.equal(gpu.pixel_values.cpu(), cpu.pixel_values)
        assert torch.equal(gpu.image_grid_thw.cpu(), cpu.image_grid_thw)


def test_digests_name_the_decoded_pixels(rng):
    """Each image's digest (the prefix cache's name for it) is the same for the same pixels, whatever
    form they come in, and changes with one value, the size or the pixels' order."""
    pixels = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    changed = pixels.copy()
    changed[rng.randrange(20), rng.randrange(30), rng.randrange(3)] ^= 1
    sources = [
        Image.fromarray(pixels),
        png.getvalue(),
        Image.fromarray(changed),
        Image.fromarray(pixels.reshape(30, 20, 3)),
    ]
    digests = preprocess_images(sources, QWEN3_VL).digests
    assert len(digests) == 4 and digests[0] == digests[1]
    assert len({digests[0], digests[2], digests[3]}) == 3


def test_decoding_on_the_host_then_preprocessing_gives_the_same_bits(rng):
    """decode_images (a server's request thread) then preprocess_decoded (the engine's device) is
    preprocess_images, bit for bit; a DecodedImages whose grids do not match its pixels is refused."""
    pixels = np.random.default_rng(rng.randrange(1 << 30))
    images = [
        Image.fromarray(pixels.integers(0, 256, (rng.randint(20, 90), rng.randint(20, 90), 3), dtype=np.uint8))
        for _ in range(3)
    ]
    want = preprocess_images(images, QWEN3_VL)
    decoded = decode_images(images, QWEN3_VL)
    assert all(rgb.dtype == torch.uint8 and rgb.shape[2] == 3 for rgb in decoded.pixels)
    got = preprocess_decoded(decoded, QWEN3_VL)
    assert torch.equal(got.pixel_values, want.pixel_values) and torch.equal(got.image_grid_thw, want.image_grid_thw)
    assert got.digests == want.digests and len(set(got.digests)) == 3
    wrong = decoded.image_grid_thw.clone()
    wrong[1, 1] += 2
    with pytest.raises(ValueError, match=r"image_grid_thw\[1\]"):
        preprocess_decoded(DecodedImages(decoded.pixels, decoded.digests, wrong), QWEN3_VL)
    with pytest.raises(ValueError, match=r"pixels\[0\] must be \[H, W, 3\] uint8"):
        DecodedImages((decoded.pixels[0].float(),), decoded.digests[:1], decoded.image_grid_thw[:1])
