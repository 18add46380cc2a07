"""Qwen3-VL video preprocessing in torch: a video given as frames → the vision tower's
`pixel_values_videos` and `video_grid_thw`, and the per-frame-group timestamps the prompt carries,
equal to transformers 5.17's Qwen3VLVideoProcessor and Qwen3VLProcessor.

A video is its frames (PIL RGB images, [H, W, 3] uint8 arrays or tensors, or one [T, H, W, 3] array)
and the rate they were taken at (`fps`). The steps, in transformers' order:
1. frame sampling (`sample_frame_indices`): `sample_fps` frames per second of the video (the
   config's `fps`, 2 by default), at least min_frames and at most max_frames and the frame count; or
   exactly `num_frames`: indices `linspace(0, T - 1, n)` rounded half to even;
2. smart resize with the temporal factor (`video_smart_resize`): sides to multiples of
   patch_size * merge_size, the pixels of all frames (frame count rounded to temporal_patch_size)
   within [min_pixels, max_pixels], optionally capped per frame (cap_pixels_per_frame);
3. resize as torchvision's `resize` of a uint8 tensor with antialiased bicubic: on the CPU torch's
   native uint8 `interpolate`; elsewhere float32 `interpolate`, clamped, rounded (torchvision's path);
4. rescale and normalize fused: `(x - mean / rescale) / (std / rescale)` in float32;
5. patchify: the frames padded to a multiple of temporal_patch_size by repeating the last, grouped
   by temporal_patch_size, rows in merge-window order and each row [channel, temporal, y, x].

Timestamps (`frame_timestamps`): the sampled indices, padded as the frames are, divided by `fps`,
averaged over each temporal group: the processor writes `<{t:.1f} seconds>` before each group.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from qruntime.shown import shown
from qruntime.vision.decode import ImageInputError
from qruntime.vision.preprocess import MAX_ASPECT_RATIO, VisionPreprocessConfig, patchify_frames

_BICUBIC = 3
MAX_VIDEO_FRAMES = 4096  # frames one video may bring (before sampling), bounding host memory and time


@dataclass(frozen=True)
class VideoPreprocessConfig:
    """A checkpoint's video_preprocessor_config.json as transformers 5.17's Qwen3VLVideoProcessor
    reads it; defaults are that class's."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32  # size.shortest_edge: over all frames of a video
    max_pixels: int = 32 * 32 * 768  # size.longest_edge
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    fps: float | None = 2  # frames sampled per second of video (None: num_frames, else every frame)
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False  # transformers 5.17's default (unset: off, with a warning)
    max_video_tokens: int = 768

    def __post_init__(self) -> None:
        keys = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "min_frames")
        for key in (*keys, "max_frames", "max_video_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"video preprocessor config: {key} must be a positive integer, got {shown(value)}")
        if self.num_frames is not None and (
            isinstance(self.num_frames, bool) or not isinstance(self.num_frames, int) or self.num_frames < 1
        ):
            raise ValueError(f"video preprocessor config: num_frames must be a positive integer, got {self.num_frames}")
        if self.fps is not None and (
            isinstance(self.fps, bool) or not isinstance(self.fps, int | float) or self.fps <= 0
        ):
            raise ValueError(f"video preprocessor config: fps must be a positive number, got {shown(self.fps)}")
        for key in ("image_mean", "image_std"):
            value = getattr(self, key)
            if len(value) != 3 or not all(isinstance(v, int | float) for v in value):
                raise ValueError(f"video preprocessor config: {key} must be 3 numbers (R, G, B), got {shown(value)}")
        if any(v == 0 for v in self.image_std):
            raise ValueError(f"video preprocessor config: image_std has a zero: {self.image_std}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> VideoPreprocessConfig:
        """From video_preprocessor_config.json's keys (`size` shortest_edge / longest_edge, or
        min_pixels / max_pixels); keys not used are ignored, settings not implemented refused."""
        size = config.get("size") or {}
        if not isinstance(size, Mapping):
            raise ValueError(f"video preprocessor config: size must be a dict, got {shown(size)}")
        fields: dict[str, Any] = {}
        for key, name in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            value = config.get(key) if config.get(key) is not None else size.get(name)
            if value is not None:
                fields[key] = value
        if config.get("resample", _BICUBIC) != _BICUBIC:
            raise ValueError(f"video preprocessor config: resample {shown(config['resample'])} is not supported (3)")
        for key in ("do_center_crop", "do_pad"):
            if config.get(key):
                raise ValueError(f"video preprocessor config: {key} is not supported for Qwen3-VL videos")
        if config.get("do_sample_frames") is False:
            raise ValueError("video preprocessor config: do_sample_frames false is not supported")
        keys = ("patch_size", "temporal_patch_size", "merge_size", "do_resize", "do_rescale", "rescale_factor")
        keys += ("do_normalize", "min_frames", "max_frames", "cap_pixels_per_frame", "max_video_tokens")
        for key in keys:
            if config.get(key) is not None:
                fields[key] = config[key]
        for key in ("fps", "num_frames"):
            if key in config:
                fields[key] = config[key]
        for key in ("image_mean", "image_std"):
            if config.get(key) is not None:
                value = config[key]
                fields[key] = tuple(value) if isinstance(value, Sequence) else (value,) * 3
        return cls(**fields)

    @classmethod
    def like_images(cls, images: VisionPreprocessConfig) -> VideoPreprocessConfig:
        """Transformers' video defaults (pixel bounds, sampling) with the image config's patch
        layout and normalization: for an artifact that records no video preprocessor config."""
        return cls(
            patch_size=images.patch_size,
            temporal_patch_size=images.temporal_patch_size,
            merge_size=images.merge_size,
            image_mean=images.image_mean,
            image_std=images.image_std,
            do_resize=images.do_resize,
            do_rescale=images.do_rescale,
            rescale_factor=images.rescale_factor,
            do_normalize=images.do_normalize,
        )


@dataclass(frozen=True)
class Video:
    """One video: its frames in order and their rate; optional sampling overrides (`sample_fps`
    frames per second, or exactly `num_frames`; at most one)."""

    frames: Any  # sequence of PIL RGB images / [H, W, 3] uint8 arrays or tensors, or [T, H, W, 3] uint8
    fps: float
    sample_fps: float | None = None
    num_frames: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.fps, bool) or not isinstance(self.fps, int | float) or not self.fps > 0:
            raise ImageInputError(f"video: fps (the frames' rate) must be a positive number, got {shown(self.fps)}")
        if self.sample_fps is not None and self.num_frames is not None:
            raise ImageInputError("video: sample_fps and num_frames exclude each other; give one")
        if self.sample_fps is not None and (
            isinstance(self.sample_fps, bool) or not isinstance(self.sample_fps, int | float) or not self.sample_fps > 0
        ):
            raise ImageInputError(f"video: sample_fps must be a positive number, got {shown(self.sample_fps)}")
        if self.num_frames is not None and (
            isinstance(self.num_frames, bool) or not isinstance(self.num_frames, int) or self.num_frames < 1
        ):
            raise ImageInputError(f"video: num_frames must be a positive integer, got {shown(self.num_frames)}")


@dataclass(frozen=True)
class VideoInputs:
    """What the vision tower takes for a prompt's videos, concatenated in order, and what the prompt
    writes for them."""

    pixel_values: torch.Tensor  # [sum of t*h*w, C * temporal_patch_size * patch_size**2] float32
    video_grid_thw: torch.Tensor  # [videos, 3] int64
    timestamps: tuple[tuple[float, ...], ...]  # per video, one per temporal group (grid t)
    digests: tuple[bytes, ...] = field(default=())  # per video: sha256 of its sampled frames


def video_smart_resize(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' Qwen3-VL video smart_resize: (height, width) multiples of factor with
    round(frames / temporal_factor) * temporal_factor * h * w within [min_pixels, max_pixels]."""
    if num_frames < temporal_factor:
        raise ImageInputError(f"video: {num_frames} frames sampled, fewer than temporal_patch_size {temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageInputError(
            f"video {width}x{height}: aspect ratio {max(height, width) / min(height, width):.1f} is over "
            f"{MAX_ASPECT_RATIO}, which Qwen-VL preprocessing refuses"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def sample_frame_indices(total: int, video: Video, config: VideoPreprocessConfig) -> list[int]:
    """Qwen3VLVideoProcessor.sample_frames: which of `total` frames are kept, in order. The video's
    num_frames or sample_fps, else the config's num_frames or fps (both set is transformers' error)."""
    if video.num_frames is not None or video.sample_fps is not None:
        num_frames, fps = video.num_frames, video.sample_fps
    elif config.num_frames is not None and config.fps is not None:
        raise ValueError("video preprocessor config: num_frames and fps exclude each other")
    else:
        num_frames, fps = config.num_frames, config.fps
    if num_frames is None and fps is not None:
        num_frames = int(total / video.fps * fps)
        num_frames = min(max(num_frames, config.min_frames), config.max_frames, total)
    if num_frames is None:
        num_frames = min(max(total, config.min_frames), config.max_frames)
    return np.linspace(0, total - 1, num_frames).round().astype(int).tolist()


def frame_timestamps(indices: Sequence[int], fps: float, temporal_patch_size: int) -> tuple[float, ...]:
    """Qwen3VLProcessor._calculate_timestamps: seconds of each temporal group (its first and last
    frame's times averaged), the indices padded with the last as the frames are."""
    indices = list(indices)
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    times = [i / fps for i in indices]
    return tuple((times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size))


def timestamp_text(seconds: float) -> str:
    """What the processor writes before a frame group."""
    return f"<{seconds:.1f} seconds>"


def video_frames(video: Video, index: int = 0) -> torch.Tensor:
    """The video's frames as one [T, H, W, 3] uint8 CPU tensor; a frame that is not RGB uint8 of the
    first frame's size is refused naming it."""
    frames = video.frames
    if isinstance(frames, np.ndarray | torch.Tensor) and frames.ndim == 4:
        frames = list(frames)
    if isinstance(frames, str | bytes) or not isinstance(frames, Sequence):
        raise ImageInputError(f"video {index}: frames must be a list of RGB frames, got {type(frames).__name__}")
    if not frames:
        raise ImageInputError(f"video {index}: no frames")
    if len(frames) > MAX_VIDEO_FRAMES:
        raise ImageInputError(f"video {index}: {len(frames)} frames, more than {MAX_VIDEO_FRAMES}")
    out = []
    for f, frame in enumerate(frames):
        if type(frame).__module__.startswith("PIL."):
            if frame.mode != "RGB":
                raise ImageInputError(f"video {index} frame {f}: mode {frame.mode}, not RGB (convert it first)")
            frame = np.array(frame)
        if isinstance(frame, np.ndarray):
            frame = torch.from_numpy(np.ascontiguousarray(frame))
        if not isinstance(frame, torch.Tensor) or frame.dtype != torch.uint8 or frame.dim() != 3 or frame.shape[2] != 3:
            what = f"{tuple(frame.shape)} {frame.dtype}" if hasattr(frame, "shape") else type(frame).__name__
            raise ImageInputError(f"video {index} frame {f}: must be an RGB image or [H, W, 3] uint8, got {what}")
        if out and frame.shape != out[0].shape:
            raise ImageInputError(
                f"video {index} frame {f}: {tuple(frame.shape)}, not the first frame's {tuple(out[0].shape)}"
            )
        out.append(frame.cpu())
    return torch.stack(out)


def preprocess_videos(
    videos: Sequence[Video], config: VideoPreprocessConfig = VideoPreprocessConfig(), *, device=None
) -> VideoInputs:
    """Sample, resize, normalize and patchify `videos` on `device` (CPU if None): what transformers'
    Qwen3VLVideoProcessor returns as pixel_values_videos and video_grid_thw, with each video's
    timestamps and a digest of its sampled frames."""
    if not videos:
        raise ValueError("preprocess_videos: no videos")
    patches, grids, stamps, digests = [], [], [], []
    for index, video in enumerate(videos):
        frames = video_frames(video, index)
        indices = sample_frame_indices(frames.shape[0], video, config)
        sampled = frames[indices]  # [T, H, W, 3]
        digests.append(hashlib.sha256(f"video|{tuple(sampled.shape)}|".encode() + sampled.numpy().tobytes()).digest())
        one, grid = _video_patches(sampled, config, device)
        patches.append(one)
        grids.append(grid)
        stamps.append(frame_timestamps(indices, video.fps, config.temporal_patch_size))
    pixel_values = torch.cat(patches) if len(patches) > 1 else patches[0]
    grid_thw = torch.tensor(grids, dtype=torch.int64, device=pixel_values.device)
    return VideoInputs(pixel_values, grid_thw, tuple(stamps), tuple(digests))


def _video_patches(frames: torch.Tensor, config: VideoPreprocessConfig, device) -> tuple[torch.Tensor, tuple]:
    x = frames.to(device).permute(0, 3, 1, 2).contiguous()  # [T, 3, H, W] uint8
    count, _, height, width = x.shape
    if config.do_resize:
        max_pixels = config.max_pixels
        if config.cap_pixels_per_frame:
            frame_cap = config.max_video_tokens * config.factor * config.factor
            per_frame = max(min(frame_cap, config.max_pixels // count), int(config.min_pixels * 1.05))
            max_pixels = per_frame * count
        new_h, new_w = video_smart_resize(
            count, height, width, config.temporal_patch_size, config.factor, config.min_pixels, max_pixels
        )
        if (new_h, new_w) != (height, width):
            x = _resize_bicubic_uint8(x, new_h, new_w)
    elif height % config.factor or width % config.factor:
        raise ImageInputError(f"video {width}x{height}: with do_resize off, sides must be multiples of {config.factor}")
    if config.do_rescale and config.do_normalize:
        mean = torch.tensor(config.image_mean, device=x.device) * (1.0 / config.rescale_factor)
        std = torch.tensor(config.image_std, device=x.device) * (1.0 / config.rescale_factor)
        x = x.to(torch.float32).sub(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    elif config.do_normalize:
        mean = torch.tensor(config.image_mean, dtype=torch.float32, device=x.device).view(-1, 1, 1)
        std = torch.tensor(config.image_std, dtype=torch.float32, device=x.device).view(-1, 1, 1)
        x = x.to(torch.float32).sub(mean).div_(std)
    elif config.do_rescale:
        x = x * config.rescale_factor
    return patchify_frames(x.to(torch.float32), config)


def _resize_bicubic_uint8(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision.transforms.v2.functional.resize of uint8 frames, bicubic, antialias (its two paths)."""
    if x.device.type == "cpu":
        return torch.nn.functional.interpolate(
            x, size=[height, width], mode="bicubic", align_corners=False, antialias=True
        )
    y = torch.nn.functional.interpolate(
        x.to(torch.float32), size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )
    return y.clamp_(0, 255).round_().to(torch.uint8)
