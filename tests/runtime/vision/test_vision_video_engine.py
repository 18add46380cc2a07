"""Qwen3-VL with videos end to end on the CPU: the tiny random synthetic checkpoints (dense tiny-vl and
MoE tiny-vl-moe, with their synthetic Qwen tokenizer) compiled (bf16 recipe: float32 as the checkpoint),
loaded by qruntime and given text prompts with videos (random frames, several lengths, sizes and
rates) and images.

Held to transformers 5.17 on the same weights, its inputs made by its own Qwen3VLProcessor (the real
Qwen3VLVideoProcessor: tests/torchvision_cpu.py) from the same text and frames: the expanded ids equal
the processor's (timestamps included), the logits at every position within 1e-5 of the largest, the
greedy tokens of a batch (video, video + images, images) generated together under a 16-token step
budget (chunks cut inside the videos) are transformers' (teacher-forced), and the prefix cache names
a video's blocks by its frames. Every weight is drawn from a fresh seed, printed.
"""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import qruntime
import torch
from PIL import Image
from qruntime.engine.multimodal import ImagePrompt, image_prompt_ids
from qruntime.engine.sampling_params import SamplingParams
from qruntime.vision.prompt import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER
from qruntime.vision.video import Video, VideoPreprocessConfig
from transformers import (
    AutoModelForImageTextToText,
    PreTrainedTokenizerFast,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.video_utils import VideoMetadata

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe
from qcompile.synth import get_preset, write_checkpoint

TOLERANCE = 1e-5
# the tiny presets' patch 4 (factor 8), a few tokens a frame group: at most 2048 pixels over all frames
VIDEO = {
    "size": {"shortest_edge": 128, "longest_edge": 2048},
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "fps": 2,
    "min_frames": 4,
    "max_frames": 8,
}
# (frames, height, width, fps) of the videos the prompts use
VIDEOS = [(9, 24, 32, 4.0), (5, 20, 20, 2.0), (12, 40, 24, 6.0)]


@pytest.fixture(scope="module", params=["tiny-vl", "tiny-vl-moe"])
def setup(request, tmp_path_factory):
    """(artifact, transformers model, processor, config): a random checkpoint compiled with bf16."""
    seed = random.randrange(1 << 30)
    print(f"synth seed {seed}")
    ckpt = tmp_path_factory.mktemp("ckpt") / request.param
    write_checkpoint(request.param, ckpt, seed=seed)
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(VIDEO))  # the artifact records it
    art = tmp_path_factory.mktemp("art") / "artifact"
    compile_checkpoint(prepare(ckpt, load_recipe("bf16")), art, workers=1, progress=False)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    preset = get_preset(request.param)
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**preset.preprocessor()),
        tokenizer=PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json")),
        video_processor=Qwen3VLVideoProcessor(**copy.deepcopy(VIDEO), cap_pixels_per_frame=False),
    )
    return art, model, processor, preset.config()


def _load(art, **kwargs):
    engine = qruntime.load(art, device="cpu", dtype=torch.float32, **kwargs)
    assert engine.vision.video_config == VideoPreprocessConfig.from_dict(VIDEO)  # from the checkpoint's file
    return engine


def _frames(rng: random.Random, count: int, height: int, width: int) -> list[np.ndarray]:
    gen = np.random.default_rng(rng.randrange(1 << 30))
    return list(gen.integers(0, 256, (count, height, width, 3), dtype=np.uint8))


def _image(rng: random.Random, width: int, height: int) -> Image.Image:
    gen = np.random.default_rng(rng.randrange(1 << 30))
    return Image.fromarray(gen.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _prompt(rng: random.Random, videos: int, images: int, words: str = "look") -> ImagePrompt:
    """Text with `videos` video and `images` image placeholders in a random order."""
    marks = [VIDEO_PLACEHOLDER] * videos + [IMAGE_PLACEHOLDER] * images
    rng.shuffle(marks)
    text = words + "".join(f"{mark} and {rng.choice(['this', 'that', 'more'])}" for mark in marks) + " end"
    chosen = rng.sample(VIDEOS, videos)
    return ImagePrompt(
        text,
        [_image(rng, rng.randrange(12, 48), rng.randrange(12, 48)) for _ in range(images)],
        [Video(_frames(rng, n, h, w), fps) for n, h, w, fps in chosen],
    )


def _theirs(processor, prompt: ImagePrompt) -> dict:
    """transformers' processor on the same text, images and frames (its own sampling and timestamps)."""
    kwargs = {}
    if prompt.videos:
        kwargs["videos"] = [np.stack(v.frames) for v in prompt.videos]
        kwargs["video_metadata"] = [VideoMetadata(total_num_frames=len(v.frames), fps=v.fps) for v in prompt.videos]
    if prompt.images:
        kwargs["images"] = list(prompt.images)
    out = processor(text=[prompt.prompt], return_tensors="pt", **kwargs)
    out.pop("attention_mask")
    return dict(out)


def _logits(model, inputs: dict, extra: list[int] | None = None) -> torch.Tensor:
    inputs = dict(inputs)
    if extra:
        tail = torch.tensor([extra], dtype=torch.int64)
        inputs["input_ids"] = torch.cat([inputs["input_ids"], tail], dim=1)
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(tail)], dim=1)
    with torch.no_grad():
        return model(**inputs).logits[0]


@pytest.mark.parametrize("videos, images", [(1, 2), (2, 1)])
def test_every_positions_logits_match_transformers(setup, rng, videos, images):
    art, model, processor, _ = setup
    prompt = _prompt(rng, videos, images)
    theirs = _theirs(processor, prompt)
    with _load(art, prefix_cache=False) as engine:
        ids, _, inputs = image_prompt_ids(prompt, engine.vision, engine.tokenizer.encode, torch.device("cpu"))
        logits = engine.score(prompt)
    assert ids == theirs["input_ids"][0].tolist()  # timestamps and per-frame tokens as the processor writes
    assert torch.equal(inputs.pixel_values, theirs["pixel_values_videos"])
    assert torch.equal(inputs.video_grid_thw, theirs["video_grid_thw"])
    expected = _logits(model, theirs)
    assert logits.shape == expected.shape
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    print(f"{videos} videos, {images} images, {len(ids)} tokens: max relative error {error:.2e}")
    assert error < TOLERANCE


def _banned(config: dict) -> dict[int, float]:
    """Generated tokens stay below the special tokens (a vision id fed back would be read as one)."""
    text = config["text_config"]
    return {token: -100.0 for token in range(text["bos_token_id"], text["vocab_size"])}


def _assert_greedy(model, processor, config, prompt: ImagePrompt, tokens: list[int]) -> None:
    """Each token is transformers' argmax after the ones before it (teacher-forced: one causal forward
    over the prompt and the tokens), or within 1e-5 of the largest logit (a near-tie that fp32
    summation order may break either way)."""
    theirs = _theirs(processor, prompt)
    first_special = config["text_config"]["bos_token_id"]
    prompt_len = theirs["input_ids"].shape[1]
    every = _logits(model, theirs, tokens[:-1])
    for i, token in enumerate(tokens):
        logits = every[prompt_len - 1 + i].clone()
        logits[first_special:] = -torch.inf
        best = int(logits.argmax())
        gap = float(logits[best] - logits[token]) / float(logits[:first_special].abs().max())
        assert token == best or gap < TOLERANCE, f"token {i}: {token} where transformers picks {best} ({gap:.2e})"


def test_greedy_tokens_of_a_batch_match_transformers(setup, rng):
    art, model, processor, config = setup
    prompts = [_prompt(rng, 1, 0), _prompt(rng, 1, 2), _prompt(rng, 0, 2)]
    params = SamplingParams(max_tokens=3, ignore_eos=True, logit_bias=_banned(config))
    with _load(art, max_num_batched_tokens=16) as engine:  # chunks cut inside the videos
        outputs = engine.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        _assert_greedy(model, processor, config, prompt, list(output.token_ids))


@pytest.mark.parametrize("setup", ["tiny-vl"], indirect=True)  # the MoE adds nothing here
def test_cached_blocks_are_reused_only_for_the_same_video(setup, rng):
    """The same prompt again reuses every full block; the same text with other frames only the
    blocks before the video's first token; its tokens are then transformers' for its own frames."""
    art, model, processor, config = setup
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(10))
    first = _prompt(rng, 1, 0, words=words)
    n, h, w, fps = VIDEOS[0]
    first = ImagePrompt(first.prompt, [], [Video(_frames(rng, n, h, w), fps)])
    other = ImagePrompt(first.prompt, [], [Video(_frames(rng, n, h, w), fps)])  # same text and size
    params = SamplingParams(max_tokens=3, ignore_eos=True, logit_bias=_banned(config))
    with _load(art, max_num_batched_tokens=16) as engine:
        ids, _, _ = image_prompt_ids(first, engine.vision, engine.tokenizer.encode, torch.device("cpu"))
        engine.generate([first], params)
        before = engine.prefix_cache_stats.hits
        engine.generate([first], params)
        reused = engine.prefix_cache_stats.hits - before
        before = engine.prefix_cache_stats.hits
        (out,) = engine.generate([other], params)
        other_hits = engine.prefix_cache_stats.hits - before
    video_first = ids.index(config["video_token_id"])
    assert video_first >= 32, "the prompt needs two full blocks of text before the video"
    assert reused == (len(ids) - 1) // 16 * 16  # every full block but the one holding the last token
    assert other_hits == video_first // 16 * 16  # the blocks of text alone
    _assert_greedy(model, processor, config, other, list(out.token_ids))


@pytest.mark.parametrize("setup", ["tiny-vl"], indirect=True)  # the MoE adds nothing here
def test_chat_with_a_video_part(setup, rng):
    """Engine.chat takes {"type": "video", "video": frames, "fps": rate}: its prompt ids are the
    processor's for the rendered text (the template's placeholder expanded with the timestamps) and
    its greedy tokens transformers'."""
    art, model, processor, config = setup
    n, h, w, fps = VIDEOS[2]
    frames = _frames(rng, n, h, w)
    content = [{"type": "video", "video": frames, "fps": fps}, {"type": "text", "text": "What happens?"}]
    params = SamplingParams(max_tokens=3, ignore_eos=True, logit_bias=_banned(config))
    with _load(art) as engine:
        [output] = engine.chat([{"role": "user", "content": content}], params)
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": VIDEO_PLACEHOLDER + "What happens?"}], add_generation_prompt=True
        )
    reference = ImagePrompt(text, [], [Video(frames, fps)])
    assert list(output.prompt_token_ids) == _theirs(processor, reference)["input_ids"][0].tolist()
    _assert_greedy(model, processor, config, reference, list(output.token_ids))
