"""Video preprocessing (qruntime.vision.video) held to transformers 5.17's Qwen3VLVideoProcessor
(torchvision's resize, tests/torchvision_cpu.py) and Qwen3VLProcessor's timestamps, and the vision
tower on videos held to transformers' get_video_features. Frames are random (the `rng` fixture
prints its seed); sizes, lengths and rates vary per case.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from PIL import Image
from qruntime.vision import ImageInputError
from qruntime.vision.tower import load_vision_tower
from qruntime.vision.tower_config import VisionTowerConfig
from qruntime.vision.video import (
    Video,
    VideoPreprocessConfig,
    frame_timestamps,
    preprocess_videos,
    timestamp_text,
)
from qwen3_vl_checkpoints import write_checkpoint
from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

# small pixel bounds so that the videos stay a few tokens (the published config's layout otherwise)
SMALL = {
    "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 48},
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "fps": 2,
    "min_frames": 4,
    "max_frames": 12,
}


def _frames(rng: random.Random, count: int, height: int, width: int, pil: bool):
    gen = np.random.default_rng(rng.randrange(1 << 30))
    base = gen.integers(0, 256, (height, width, 3), dtype=np.int16)  # a scene, moving noise on top
    frames = [np.clip(base + gen.integers(-40, 41, (height, width, 3)), 0, 255).astype(np.uint8) for _ in range(count)]
    return [Image.fromarray(f) for f in frames] if pil else frames


def _theirs(video: Video, frames, extra: dict | None = None):
    processor = Qwen3VLVideoProcessor(**copy.deepcopy({**SMALL, **(extra or {})}))
    kwargs = {"cap_pixels_per_frame": bool((extra or {}).get("cap_pixels_per_frame"))}
    if video.num_frames is not None:
        kwargs.update(num_frames=video.num_frames, fps=None)
    elif video.sample_fps is not None:
        kwargs["fps"] = video.sample_fps
    array = np.stack([np.asarray(f) for f in frames])
    meta = VideoMetadata(total_num_frames=len(frames), fps=video.fps)
    out = processor(videos=[array], video_metadata=[meta], return_metadata=True, return_tensors="pt", **kwargs)
    return out


# (frames, height, width, fps, sample_fps, num_frames, PIL frames, extra config)
CASES = [
    (10, 40, 56, 4.0, None, None, False, {}),  # 5 frames sampled: padded to 6
    (7, 33, 47, 3.0, None, None, True, {}),  # too few for fps: min_frames 4
    (30, 64, 48, 24.0, 6.0, None, False, {}),  # 7 frames at sample_fps 6
    (9, 20, 90, 30.0, None, 5, True, {}),  # exactly 5 frames; a side below the factor
    (16, 120, 160, 8.0, None, None, False, {"cap_pixels_per_frame": True}),  # max_pixels bites, per frame
    (12, 96, 96, 2.0, None, None, False, {"fps": 1.5}),  # the config's own rate
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}" for c in CASES])
def test_video_preprocessing_equals_transformers(rng, case):
    count, height, width, fps, sample_fps, num_frames, pil, extra = case
    frames = _frames(rng, count, height, width, pil)
    video = Video(frames, fps, sample_fps=sample_fps, num_frames=num_frames)
    config = VideoPreprocessConfig.from_dict({**SMALL, **extra})
    ours = preprocess_videos([video], config)
    theirs = _theirs(video, frames, extra)
    assert torch.equal(ours.video_grid_thw, theirs["video_grid_thw"])
    assert ours.pixel_values.dtype == theirs["pixel_values_videos"].dtype == torch.float32
    assert torch.equal(ours.pixel_values, theirs["pixel_values_videos"])  # bit for bit
    meta = theirs["video_metadata"][0]
    hf = Qwen3VLProcessor.__new__(Qwen3VLProcessor)  # _calculate_timestamps reads no state
    expected = hf._calculate_timestamps(meta.frames_indices, meta.fps, SMALL["temporal_patch_size"])
    assert ours.timestamps == (tuple(expected),)
    assert len(ours.timestamps[0]) == int(ours.video_grid_thw[0, 0])


def test_videos_batched_equal_each_alone(rng):
    config = VideoPreprocessConfig.from_dict(SMALL)
    videos = [Video(_frames(rng, n, h, w, False), f) for n, h, w, f in ((8, 40, 40, 4.0), (6, 30, 70, 2.0))]
    both = preprocess_videos(videos, config)
    alone = [preprocess_videos([v], config) for v in videos]
    assert torch.equal(both.pixel_values, torch.cat([a.pixel_values for a in alone]))
    assert torch.equal(both.video_grid_thw, torch.cat([a.video_grid_thw for a in alone]))
    assert both.timestamps == alone[0].timestamps + alone[1].timestamps
    assert both.digests == alone[0].digests + alone[1].digests and both.digests[0] != both.digests[1]


def test_timestamps_and_their_text():
    # indices 0, 2, 4, 7, 9 at 4 fps: padded with 9, groups (0, .5), (1, 1.75), (2.25, 2.25)
    assert frame_timestamps([0, 2, 4, 7, 9], 4.0, 2) == (0.25, 1.375, 2.25)
    assert [timestamp_text(t) for t in (0.25, 1.375, 2.25)] == ["<0.2 seconds>", "<1.4 seconds>", "<2.2 seconds>"]


@pytest.mark.parametrize(
    "video, match",
    [
        (lambda f: Video(f, 0.0), "fps"),
        (lambda f: Video(f, 2.0, sample_fps=1.0, num_frames=4), "exclude"),
        (lambda f: Video([], 2.0), "no frames"),
        (lambda f: Video([*f[:3], f[3][:, :-1]], 2.0), "frame 3"),
        (lambda f: Video([*f[:3], f[3].astype(np.float32)], 2.0), "frame 3"),
        (lambda f: Video([*f[:2], Image.fromarray(f[2]).convert("L"), *f[3:]], 2.0), "frame 2: mode L"),
        (lambda f: Video(f[:1], 2.0, num_frames=1), "fewer than temporal_patch_size"),
    ],
)
def test_bad_videos_are_refused_by_name(rng, video, match):
    frames = _frames(rng, 6, 32, 32, False)
    with pytest.raises(ImageInputError, match=match):
        preprocess_videos([video(frames)], VideoPreprocessConfig.from_dict(SMALL))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl-video")
    return root, write_checkpoint(root, "dense")  # prints its seed


def test_tower_on_videos_equals_get_video_features(dense, rng):
    import json

    from safetensors.torch import load_file

    root, model = dense
    vision_config = json.loads((root / "config.json").read_text())["vision_config"]
    # the tiny checkpoint's patch 4 (factor 8): frames of at most 24 x 24 pixels after the resize
    config = VideoPreprocessConfig.from_dict(
        {**SMALL, "patch_size": 4, "size": {"shortest_edge": 64 * 4, "longest_edge": 24 * 24 * 4}}
    )
    videos = [Video(_frames(rng, 10, 40, 56, False), 4.0), Video(_frames(rng, 7, 33, 47, True), 3.0)]
    inputs = preprocess_videos(videos, config)
    assert (inputs.video_grid_thw[:, 0] > 1).all()
    tensors = {k: v for k, v in load_file(str(root / "model.safetensors")).items() if k.startswith("model.visual.")}
    tower = load_vision_tower(tensors, VisionTowerConfig.from_dict(vision_config))
    embeds, deepstack = tower(inputs.pixel_values, inputs.video_grid_thw)
    with torch.no_grad():
        out = model.model.get_video_features(
            pixel_values_videos=inputs.pixel_values, video_grid_thw=inputs.video_grid_thw
        )
    theirs = torch.cat(out.pooler_output)
    assert embeds.shape == theirs.shape
    worst = (embeds - theirs).abs().max() / theirs.abs().max()
    print(f"embeddings: {worst:.2e} of the largest")
    assert worst < 1e-5
    assert len(deepstack) == len(out.deepstack_features) > 0
    for ours, ref in zip(deepstack, out.deepstack_features, strict=True):
        rel = (ours - ref).abs().max() / ref.abs().max()
        print(f"deepstack: {rel:.2e}")
        assert rel < 1e-5


def test_video_token_expansion_checks_its_input(rng):
    from qruntime.vision.positions import VisionTokenConfig
    from qruntime.vision.prompt_images import expand_video_tokens

    tokens = VisionTokenConfig(image_token_id=90, video_token_id=91, vision_start_token_id=92, spatial_merge_size=2)
    config = VideoPreprocessConfig.from_dict(
        {**SMALL, "patch_size": 4, "size": {"shortest_edge": 256, "longest_edge": 4096}}
    )
    inputs = preprocess_videos([Video(_frames(rng, 6, 16, 24, False), 2.0)], config)
    stamps = {timestamp_text(t): [80 + i] for i, t in enumerate(inputs.timestamps[0])}
    encode = stamps.__getitem__  # each timestamp's text to one id of its own
    t, h, w = inputs.video_grid_thw[0].tolist()
    out = expand_video_tokens([5, 92, 91, 93, 6], inputs, tokens, encode)
    group = [92] + [91] * (h * w // 4) + [93]
    assert out == [5, 92, *[x for i in range(t) for x in [80 + i, *group]], 93, 6]
    for ids, words in (
        ([5, 92, 91, 93, 92, 91, 93], "2 video tokens .* for 1 videos"),
        ([5, 91, 93], "does not follow vision_start"),
        ([5, 92, 91], "not followed by vision_end"),
        ([5, 92, 91, 90], "not followed by vision_end"),
    ):
        with pytest.raises(ValueError, match=words):
            expand_video_tokens(ids, inputs, tokens, encode)
    with pytest.raises(ValueError, match="encodes to vision tokens"):
        expand_video_tokens([5, 92, 91, 93], inputs, tokens, lambda text: [91])
