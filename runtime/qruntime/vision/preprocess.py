"""Qwen3-VL image preprocessing in torch: an image → the vision tower's `pixel_values` and
`image_grid_thw`, equal to transformers 5.17's Qwen3-VL image processor (`Qwen2VLImageProcessor*`).

The steps, in transformers' order:
1. decode (decode.py) and convert to RGB with Pillow (`do_convert_rgb`);
2. smart resize: height and width rounded to multiples of patch_size * merge_size, the pixel count
   brought within [min_pixels, max_pixels] (the `size` dict's shortest_edge / longest_edge) keeping
   the aspect ratio; aspect ratios over 200 refused;
3. resize with Pillow's antialiased BICUBIC, computed bit for bit in torch (resample.py, which says
   why Pillow's and not torch's interpolate);
4. rescale in float64 (`uint8 * rescale_factor`), then cast to float32; normalize in float32,
   `(x - mean) / std` — numpy's arithmetic in transformers' PIL backend, so results are bit-exact;
5. patchify: the single image repeated temporal_patch_size times, cut into patch_size squares, the
   rows ordered by merge window (grid_h/m, grid_w/m, m, m) and each row flattened as
   [channel, temporal, patch_y, patch_x].

Everything after decoding runs on `device`; integer resizing and IEEE float32/float64 arithmetic
should make a GPU's result equal the CPU's (tested on CPU so far: tests/runtime/vision).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qruntime.shown import shown
from qruntime.vision.decode import DEFAULT_MAX_IMAGE_PIXELS, ImageInputError, ImageSource, load_image
from qruntime.vision.resample import resize_bicubic

MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses longer / shorter side above this
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' OPENAI_CLIP_MEAN / _STD, its defaults
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the `resample` value of every Qwen-VL checkpoint


@dataclass(frozen=True)
class VisionPreprocessConfig:
    """The checkpoint's preprocessor_config.json, as transformers 5.17 reads it. Defaults are
    transformers' class defaults (Qwen2-VL's); QWEN3_VL holds the published Qwen3-VL values."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        for key in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"preprocessor config: {key} must be a positive integer, got {shown(value)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"preprocessor config: min_pixels ({self.min_pixels}) is above max_pixels ({self.max_pixels})"
            )
        for key in ("image_mean", "image_std"):
            value = getattr(self, key)
            if len(value) != 3 or not all(isinstance(v, (int, float)) for v in value):
                raise ValueError(f"preprocessor config: {key} must be 3 numbers (R, G, B), got {shown(value)}")
        if any(v == 0 for v in self.image_std):
            raise ValueError(f"preprocessor config: image_std has a zero: {self.image_std}")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> VisionPreprocessConfig:
        """From preprocessor_config.json's keys, read as transformers 5.17 reads them: `size`
        (shortest_edge / longest_edge: the pixel-count bounds), overridden by top-level min_pixels /
        max_pixels when present. Keys this preprocessing does not use are ignored; settings it does
        not implement (a resample other than bicubic) are refused."""
        size = config.get("size")
        if size is None:
            min_pixels, max_pixels = cls.min_pixels, cls.max_pixels
        elif isinstance(size, Mapping):
            min_pixels, max_pixels = size.get("shortest_edge"), size.get("longest_edge")
        else:
            raise ValueError(f"preprocessor config: size must be a dict, got {shown(size)}")
        min_pixels = config.get("min_pixels") if config.get("min_pixels") is not None else min_pixels
        max_pixels = config.get("max_pixels") if config.get("max_pixels") is not None else max_pixels
        for key, value in (("size.shortest_edge", min_pixels), ("size.longest_edge", max_pixels)):
            if not value:
                raise ValueError(f"preprocessor config: {key} (or {key.split('.')[1]}'s min/max_pixels) is missing")
        resample = config.get("resample", _BICUBIC)
        if resample != _BICUBIC:
            raise ValueError(f"preprocessor config: resample {shown(resample)} is not supported (only 3, bicubic)")
        for key in ("do_center_crop", "do_pad"):
            if config.get(key):
                raise ValueError(f"preprocessor config: {key} is not supported for Qwen-VL images")
        fields = {}
        for key in ("patch_size", "temporal_patch_size", "merge_size", "do_resize", "do_rescale"):
            if config.get(key) is not None:
                fields[key] = config[key]
        for key in ("do_normalize", "do_convert_rgb", "rescale_factor"):
            if config.get(key) is not None:
                fields[key] = config[key]
        for key in ("image_mean", "image_std"):
            if config.get(key) is not None:
                value = config[key]
                fields[key] = tuple(value) if isinstance(value, Sequence) else (value,) * 3
        return cls(min_pixels=min_pixels, max_pixels=max_pixels, **fields)


QWEN3_VL = VisionPreprocessConfig(
    patch_size=16,
    min_pixels=65536,
    max_pixels=16777216,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
)  # preprocessor_config.json of the published Qwen3-VL checkpoints (dense and MoE)


@dataclass(frozen=True)
class VisionInputs:
    """What the vision tower takes for a batch of images, concatenated in order."""

    pixel_values: torch.Tensor  # [sum of t*h*w over images, C * temporal_patch_size * patch_size**2] float32
    image_grid_thw: torch.Tensor  # [images, 3] int64: (t, h, w) in patches per image
    # per image, sha256 of its decoded RGB pixels and size (what the patches are a function of, given
    # the config): the prefix cache's name for it, hashed on the host before the patches are made
    digests: tuple[bytes, ...] = ()


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The resized (height, width): multiples of `factor`, pixel count within [min_pixels, max_pixels]
    (except that a side never drops below `factor`), aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageInputError(
            f"image {width}x{height}: aspect ratio {max(height, width) / min(height, width):.1f} is over "
            f"{MAX_ASPECT_RATIO}, which Qwen-VL preprocessing refuses"
        )
    # Python's round (half to even), as transformers uses
    new_h, new_w = round(height / factor) * factor, round(width / factor) * factor
    if new_h * new_w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        new_h = max(factor, math.floor(height / beta / factor) * factor)
        new_w = max(factor, math.floor(width / beta / factor) * factor)
    elif new_h * new_w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        new_h = math.ceil(height * beta / factor) * factor
        new_w = math.ceil(width * beta / factor) * factor
    return new_h, new_w


def preprocess_images(
    images: Sequence[ImageSource],
    config: VisionPreprocessConfig = QWEN3_VL,
    *,
    device: torch.device | str | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> VisionInputs:
    """Decode, resize, normalize and patchify `images`: what transformers' processor returns as
    `pixel_values` and `image_grid_thw` for the same images. Tensors are on `device` (CPU if None)."""
    return preprocess_decoded(decode_images(images, config, max_image_pixels=max_image_pixels), config, device=device)


@dataclass(frozen=True)
class DecodedImages:
    """Images decoded to RGB on the host, before the resize (which preprocess_decoded runs where the
    encoder is): what a server's request threads hand the engine, so that the engine's device
    preprocesses and no engine time goes to decoding or hashing."""

    pixels: tuple[torch.Tensor, ...]  # per image, [H, W, 3] uint8 on the CPU
    digests: tuple[bytes, ...]  # VisionInputs.digests of them
    image_grid_thw: torch.Tensor  # [images, 3] int64 on the CPU: the grid preprocessing makes of each

    def __post_init__(self) -> None:
        images = len(self.pixels)
        if not images or len(self.digests) != images or tuple(self.image_grid_thw.shape) != (images, 3):
            raise ValueError(
                f"DecodedImages: {images} images, {len(self.digests)} digests, grids {tuple(self.image_grid_thw.shape)}"
            )
        for index, rgb in enumerate(self.pixels):
            if rgb.dtype != torch.uint8 or rgb.dim() != 3 or rgb.shape[2] != 3:
                raise ValueError(
                    f"DecodedImages.pixels[{index}] must be [H, W, 3] uint8, got {tuple(rgb.shape)} {rgb.dtype}"
                )


def image_grid(height: int, width: int, config: VisionPreprocessConfig) -> tuple[int, int, int]:
    """The (t, h, w) patch grid preprocessing makes of a height x width image (its resize, then patches)."""
    if config.do_resize:
        height, width = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    elif height % config.factor or width % config.factor:
        raise ImageInputError(
            f"image {width}x{height}: with do_resize off, both sides must be multiples of {config.factor}"
        )
    return 1, height // config.patch_size, width // config.patch_size


def decode_images(
    images: Sequence[ImageSource],
    config: VisionPreprocessConfig = QWEN3_VL,
    *,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> DecodedImages:
    """Each image decoded (bounded: load_image), converted to RGB and hashed, on the host; its grid
    checked (aspect ratio, do_resize off: sides)."""
    if not images:
        raise ValueError("preprocess_images: no images")
    pixels, digests, grids = [], [], []
    for source in images:
        image = load_image(source, max_pixels=max_image_pixels)
        if config.do_convert_rgb and image.mode != "RGB":
            image = image.convert("RGB")
        elif image.mode != "RGB":
            raise ImageInputError(f"image mode {image.mode}: do_convert_rgb is off, so only RGB images are taken")
        array = np.array(image, dtype=np.uint8)  # [H, W, 3]
        digests.append(hashlib.sha256(f"rgb|{array.shape}|".encode() + array.tobytes()).digest())
        grids.append(image_grid(array.shape[0], array.shape[1], config))
        pixels.append(torch.from_numpy(array))
    return DecodedImages(tuple(pixels), tuple(digests), torch.tensor(grids, dtype=torch.int64))


def preprocess_decoded(
    decoded: DecodedImages, config: VisionPreprocessConfig = QWEN3_VL, *, device: torch.device | str | None = None
) -> VisionInputs:
    """Resize, normalize and patchify decoded images on `device` (CPU if None): preprocess_images's
    result, bit for bit, wherever the decoding ran."""
    patches = []
    for index, (rgb, declared) in enumerate(zip(decoded.pixels, decoded.image_grid_thw.tolist(), strict=True)):
        one, grid = _patches(rgb, config, device)
        if list(grid) != declared:
            raise ValueError(f"DecodedImages.image_grid_thw[{index}] is {declared}; image {index} makes {list(grid)}")
        patches.append(one)
    pixel_values = torch.cat(patches) if len(patches) > 1 else patches[0]
    grid_thw = decoded.image_grid_thw.to(device)
    return VisionInputs(pixel_values=pixel_values, image_grid_thw=grid_thw, digests=decoded.digests)


def _patches(rgb: torch.Tensor, config: VisionPreprocessConfig, device) -> tuple[torch.Tensor, tuple[int, int, int]]:
    x = rgb.to(device).permute(2, 0, 1)  # [3, H, W] uint8
    height, width = x.shape[1:]
    if config.do_resize:
        new_h, new_w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
        if (new_h, new_w) != (height, width):
            x = resize_bicubic(x, new_h, new_w)
    if config.do_rescale:
        x = (x.to(torch.float64) * config.rescale_factor).to(torch.float32)
    if config.do_normalize:
        mean = torch.tensor(config.image_mean, dtype=torch.float32, device=x.device)[:, None, None]
        std = torch.tensor(config.image_std, dtype=torch.float32, device=x.device)[:, None, None]
        x = (x.to(torch.float32) - mean) / std
    return patchify(x.to(torch.float32), config)


def patchify(image: torch.Tensor, config: VisionPreprocessConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[C, H, W] → ([grid_h * grid_w, C * T * p * p], (1, grid_h, grid_w)), rows in merge-window order:
    one frame repeated temporal_patch_size times (patchify_frames)."""
    return patchify_frames(image.unsqueeze(0).expand(config.temporal_patch_size, -1, -1, -1), config)


def patchify_frames(
    frames: torch.Tensor, config: VisionPreprocessConfig | Any
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[T, C, H, W] → ([grid_t * grid_h * grid_w, C * tp * p * p], (grid_t, grid_h, grid_w)): frames
    padded with the last to a multiple of tp, grouped by tp, rows in merge-window order per group
    (`config`: an image or video preprocessor config, its patch_size, merge_size, temporal_patch_size)."""
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    if pad := -frames.shape[0] % tp:
        frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)))
    count, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = count // tp, height // p, width // p
    x = frames.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, tp, p, p]
    return x.reshape(grid_t * grid_h * grid_w, channels * tp * p * p), (grid_t, grid_h, grid_w)
