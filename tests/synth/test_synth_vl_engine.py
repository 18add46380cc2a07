"""Synthetic Qwen3-VL end to end on the CPU: `qcompile synth` of the tiny VL presets compiled, loaded
and run with images (held to transformers on the same checkpoint), and `synth --artifact` of a VL
preset loaded with random weights in both graphs and chatting with an image."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import qruntime
import torch
from click.testing import CliRunner
from PIL import Image
from qruntime.engine.multimodal import ImagePrompt
from qruntime.engine.sampling_params import SamplingParams
from qruntime.synthetic import random_tensor
from qruntime.vision.preprocess import VisionPreprocessConfig, preprocess_images
from transformers import AutoModelForImageTextToText

from qcompile.cli import main
from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe
from qcompile.synth import get_preset, write_checkpoint

TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=["tiny-vl", "tiny-vl-moe"])
def synth_vl(request, tmp_path_factory):
    """(preset, checkpoint dir, artifact dir): a random checkpoint (seed printed) compiled with bf16."""
    seed = random.randrange(1 << 30)
    print(f"synth seed {seed}")
    ckpt = tmp_path_factory.mktemp("ckpt") / request.param
    write_checkpoint(request.param, ckpt, seed=seed)
    art = tmp_path_factory.mktemp("art") / "artifact"
    compile_checkpoint(prepare(ckpt, load_recipe("bf16")), art, workers=1, progress=False)
    return request.param, ckpt, art


def _image(rng: random.Random, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _ids(config: dict, rng: random.Random) -> list[int]:
    """text, <|vision_start|><|image_pad|><|vision_end|>, text (ids of the preset's config)."""
    text = config["text_config"]["bos_token_id"]  # ids below it are trained tokens
    words = lambda: [rng.randrange(text) for _ in range(rng.randint(2, 5))]  # noqa: E731
    return (
        words() + [config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]] + words()
    )


def test_synth_checkpoint_compiles_and_matches_transformers_with_an_image(synth_vl, rng):
    preset, ckpt, art = synth_vl
    config = get_preset(preset).config()
    prompt = ImagePrompt(_ids(config, rng), [_image(rng, (40, 24))])
    vision = preprocess_images(prompt.images, VisionPreprocessConfig.from_dict(get_preset(preset).preprocessor()))
    tokens = int(vision.image_grid_thw.prod()) // 4
    image = config["image_token_id"]
    expanded = [t for token in prompt.prompt for t in ([image] * tokens if token == image else [token])]
    ids = torch.tensor(expanded)[None]
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(
            input_ids=ids,
            pixel_values=vision.pixel_values,
            image_grid_thw=vision.image_grid_thw,
            mm_token_type_ids=(ids == image).to(torch.int32),
        ).logits[0]
    with qruntime.load(art, device="cpu", dtype=torch.float32, prefix_cache=False) as engine:
        logits = engine.score(prompt)
        other = engine.score(ImagePrompt(prompt.prompt, [_image(rng, (40, 24))]))
    assert logits.shape == expected.shape == (len(expanded), config["text_config"]["vocab_size"])
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    print(f"{preset}: {tokens} image tokens, max relative error {error:.2e}")
    assert error < TOLERANCE
    first = expanded.index(image)
    scale = float(logits.abs().max())
    assert (logits[first:] - other[first:]).abs().max() > 100 * TOLERANCE * scale  # the image reaches the text
    assert (logits[:first] - other[:first]).abs().max() < TOLERANCE * scale  # and nothing before it


def test_synth_checkpoint_chats_with_an_image(synth_vl, rng):
    preset, _, art = synth_vl
    config = get_preset(preset).config()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": _image(rng, (32, 48))}, {"type": "text", "text": "What is it?"}],
        }
    ]
    with qruntime.load(art, device="cpu", dtype=torch.float32) as engine:
        [output] = engine.chat(messages, SamplingParams(max_tokens=4, ignore_eos=True))
    ids = list(output.prompt_token_ids)
    start, end = ids.index(config["vision_start_token_id"]), ids.index(config["vision_end_token_id"])
    assert ids[start + 1 : end] == [config["image_token_id"]] * (32 // 8) * (48 // 8)  # merged 8 x 8 pixels
    assert len(output.token_ids) == 4


def test_synthetic_vl_artifact_makes_random_vision_weights_and_chats(tmp_path, rng):
    out = tmp_path / "synthetic"
    result = CliRunner().invoke(main, ["synth", "tiny-vl-moe", "-o", str(out), "--artifact"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["synthetic"]["preset"] == "tiny-vl-moe" and "vision" in manifest
    image = _image(rng, (40, 24))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi"}]}]
    with qruntime.load(out, device="cpu", dtype=torch.float32) as engine:
        encoder = engine.vision.encoder
        name = "model.visual.blocks.0.attn.qkv.weight"
        weight = encoder.weights[name]
        assert torch.equal(weight, random_tensor(name, list(weight.shape), torch.float32, torch.device("cpu")))
        bias = encoder.weights["model.visual.blocks.0.attn.qkv.bias"]
        assert 0.015 < float(weight.std()) < 0.025 and float(bias.abs().mean()) < 0.1  # biases around 0, not 1
        [output] = engine.chat(messages, SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(output.token_ids) == 3
        ids = _ids(get_preset("tiny-vl-moe").config(), rng)
        scores = [engine.score(ImagePrompt(ids, [i])) for i in (image, _image(rng, (40, 24)))]
        assert torch.isfinite(scores[0]).all() and not torch.allclose(*scores)  # the random tower sees the image
