"""Qwen3-VL end to end on the CPU: a tiny random checkpoint (dense and MoE) saved by transformers 5.17,
compiled by qcompile (unquantized, fused; float32 as the checkpoint), loaded by qruntime, and run with
real images (PIL, random pixels, several sizes) through the engine's preprocessing, the vision graph
and the text graph.

Held to transformers on the same weights: the logits at every position of prompts with 0, 1 and 3
images within 1e-5 of the largest; and the greedy tokens of those prompts generated together in one
batch equal to transformers' greedy continuation of each. Every weight is drawn from a fresh seed,
printed."""

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
from qruntime.vision.preprocess import VisionPreprocessConfig, preprocess_images
from qwen3_vl_checkpoints import END, IMAGE, PREPROCESSOR, START, TEXT, VISION, write_checkpoint

from qcompile.cli import main as qcompile_cli
from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe

TOLERANCE = 1e-5
# generated tokens never take the ids of vision tokens: transformers would read one as an image token
# when the sequence is fed back whole (the engine, like its generate, places it as text)
NO_VISION_IDS = {token: -100.0 for token in range(IMAGE, TEXT["vocab_size"])}
SIZES = {0: [], 1: [(40, 24)], 3: [(33, 47), (16, 16), (48, 20)]}  # (width, height) of each image


@pytest.fixture(scope="module", params=["dense", "moe"])
def compiled_vl(request, tmp_path_factory):
    """(artifact dir, the transformers model): a random checkpoint compiled with the bf16 recipe."""
    ckpt = tmp_path_factory.mktemp(f"{request.param}-ckpt")
    model = write_checkpoint(ckpt, request.param)
    out = tmp_path_factory.mktemp(f"{request.param}-art") / "artifact"
    compile_checkpoint(prepare(ckpt, load_recipe("bf16"), tokenizer=False), out, workers=1, progress=False)
    return out, model


def _images(sizes, rng: random.Random) -> list[Image.Image]:
    generator = np.random.default_rng(rng.randrange(1 << 30))
    return [Image.fromarray(generator.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def _prompt(images: int, rng: random.Random) -> ImagePrompt:
    """Text ids, and per image vision_start, one image token, vision_end and more text."""
    ids = [rng.randrange(IMAGE) for _ in range(rng.randint(1, 5))]
    for _ in range(images):
        ids += [START, IMAGE, END] + [rng.randrange(IMAGE) for _ in range(rng.randint(1, 4))]
    return ImagePrompt(ids, _images(SIZES[images], rng))


def _transformers(model, prompt: ImagePrompt):
    """(expanded ids [T], transformers' inputs) of a prompt, its images preprocessed as qruntime does
    (equal to transformers' own processor: tests/runtime/vision/test_vision_preprocess.py)."""
    ids = torch.tensor(prompt.prompt)
    if not prompt.images:
        return ids, {}
    vision = preprocess_images(prompt.images, VisionPreprocessConfig.from_dict(PREPROCESSOR))
    counts = (vision.image_grid_thw.prod(-1) // 4).tolist()
    expanded = []
    for token in prompt.prompt:
        expanded += [IMAGE] * counts.pop(0) if token == IMAGE else [token]
    return torch.tensor(expanded), dict(pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw)


def _logits(model, ids: torch.Tensor, kwargs) -> torch.Tensor:
    if kwargs:  # the image tokens' type, as the processor returns it with input_ids
        kwargs = dict(kwargs, mm_token_type_ids=(ids == IMAGE).to(torch.int32)[None])
    with torch.no_grad():
        return model(input_ids=ids[None], **kwargs).logits[0]


@pytest.mark.parametrize("images", [0, 1, 3])
def test_every_positions_logits_match_transformers(compiled_vl, images, rng):
    path, model = compiled_vl
    prompt = _prompt(images, rng)
    ids, kwargs = _transformers(model, prompt)
    expected = _logits(model, ids, kwargs)
    with qruntime.load(path, device="cpu", dtype=torch.float32, prefix_cache=False) as engine:
        logits = engine.score(prompt)
    assert logits.shape == expected.shape == (len(ids), TEXT["vocab_size"])
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    print(f"max relative error {error:.2e}")
    assert error < TOLERANCE


def test_greedy_tokens_of_a_batch_match_transformers(compiled_vl, rng):
    path, model = compiled_vl
    prompts = [_prompt(n, rng) for n in (0, 1, 3)]
    steps = 5
    params = SamplingParams(max_tokens=steps, ignore_eos=True, logit_bias=NO_VISION_IDS)
    with qruntime.load(path, device="cpu", dtype=torch.float32, max_num_batched_tokens=16) as engine:
        outputs = engine.generate(prompts, params)  # chunked: prompts span steps, cut inside images
    for prompt, output in zip(prompts, outputs, strict=True):
        _assert_greedy(model, prompt, list(output.token_ids))


def _assert_greedy(model, prompt: ImagePrompt, tokens: list[int]) -> None:
    """`tokens` are transformers' greedy continuation of `prompt`, teacher-forced (the whole sequence
    each time: positions past the prompt at index + delta): each is the argmax of transformers' logits
    after the ones before it, or within 1e-5 of the largest logit of it (a near-tie, which fp32
    summation order may break either way; a wrong image, position or cache block is far off that)."""
    ids, kwargs = _transformers(model, prompt)
    for i, token in enumerate(tokens):
        logits = _logits(model, torch.cat([ids, torch.tensor(tokens[:i], dtype=ids.dtype)]), kwargs)[-1]
        logits[IMAGE:] = -torch.inf  # the vision ids, which the engine's requests ban (NO_VISION_IDS)
        best = int(logits.argmax())
        gap = float(logits[best] - logits[token]) / float(logits[:IMAGE].abs().max())
        assert token == best or gap < TOLERANCE, f"token {i}: {token} where transformers picks {best} ({gap:.2e})"


def test_cached_blocks_are_reused_only_for_the_same_images(compiled_vl, rng):
    """With the prefix cache on, a prompt's blocks before its image are found again by a prompt with
    the same text and another image, but the blocks from the image on are not: its greedy tokens are
    transformers' for its own image. The same prompt again reuses all its full blocks."""
    path, model = compiled_vl
    text = [rng.randrange(IMAGE) for _ in range(40)]  # two and a half blocks of 16 before the image
    first = ImagePrompt([*text, START, IMAGE, END, 7, 9], _images([(48, 40)], rng))
    other = ImagePrompt(first.prompt, _images([(48, 40)], rng))  # the same ids, other pixels
    params = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias=NO_VISION_IDS)
    with qruntime.load(path, device="cpu", dtype=torch.float32, max_num_batched_tokens=16) as engine:
        engine.generate([first], params)
        before = engine.prefix_cache_stats
        (again,) = engine.generate([first], params)
        reused = engine.prefix_cache_stats.hits - before.hits
        before = engine.prefix_cache_stats
        (out,) = engine.generate([other], params)
        other_hits = engine.prefix_cache_stats.hits - before.hits
    ids, _ = _transformers(model, first)
    assert reused == (len(ids) - 1) // 16 * 16  # every full block but the one holding the last token
    assert other_hits == 32  # the two blocks of text alone: the third holds the image's first token
    _assert_greedy(model, other, list(out.token_ids))


def test_inspect_shows_the_vision_part(compiled_vl):
    path, _ = compiled_vl
    result = CliRunner().invoke(qcompile_cli, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    vision = json.loads(result.output)["vision"]
    assert vision["graph"] == "vision.onnx" and vision["depth"] == VISION["depth"]
    assert vision["deepstack_layers"] == len(VISION["deepstack_visual_indexes"])
    assert vision["mrope_section"] == TEXT["rope_parameters"]["mrope_section"]
    assert vision["tower_tensors"] > 0 and vision["pixels"] == [64, 48 * 48]
    text = CliRunner().invoke(qcompile_cli, ["inspect", str(path)])
    assert text.exit_code == 0 and "vision" in text.output and "DeepStack into 2 layers" in text.output
