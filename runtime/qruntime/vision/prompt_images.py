"""A split chat prompt's images and token ids (prompt.py splits the messages).

- `probe_images`: each image's header read (format, width, height) and held to the pixel limit and
  Qwen-VL's aspect-ratio bound, no pixel decoded: cheap enough to refuse a bad image up front.
- `load_prompt_images`: each image decoded (decode.py, bounded) and preprocessed (preprocess.py)
  into one VisionInputs, a failure named by its message and part; `decode_prompt_images` stops
  before the resize (DecodedImages: a server's request thread decodes, the engine's device resizes).
- `expand_image_tokens`: the rendered prompt's ids with each single <|image_pad|> token (the
  placeholder's) repeated t * h * w / merge² times for its image of grid (t, h, w): what
  transformers' Qwen3VLProcessor writes, so the ids line up with the vision tower's embeddings.
- `encode_prompt`: messages → MultimodalPrompt (token ids and VisionInputs), all of the above.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qruntime.vision.decode import FORMATS, ImageInputError, load_image
from qruntime.vision.positions import VisionTokenConfig
from qruntime.vision.preprocess import (
    MAX_ASPECT_RATIO,
    QWEN3_VL,
    DecodedImages,
    VisionInputs,
    VisionPreprocessConfig,
    decode_images,
    preprocess_decoded,
)
from qruntime.vision.prompt import DEFAULT_LIMITS, ImageLimits, ImageRef, PromptImageError, SplitMessages, split_images
from qruntime.vision.video import VideoInputs, VideoPreprocessConfig, preprocess_videos, timestamp_text

if TYPE_CHECKING:
    from qruntime.tokenizer import Tokenizer


@dataclass(frozen=True)
class MultimodalPrompt:
    """A chat prompt ready for a Qwen3-VL model: `token_ids` with every image's tokens expanded,
    `vision` the images' pixel_values and image_grid_thw in the same order (None without images),
    or the images decoded on the host (DecodedImages), which the engine preprocesses on its device."""

    token_ids: list[int]
    vision: VisionInputs | DecodedImages | None
    messages: tuple[dict[str, Any], ...]  # as rendered: contents as text with the placeholders
    images: tuple[ImageRef, ...]
    videos: VideoInputs | None = None  # the videos' patches and timestamps, in prompt order


def probe_images(split: SplitMessages, limits: ImageLimits = DEFAULT_LIMITS) -> list[tuple[int, int]]:
    """(width, height) of each image from its header, refused (PromptImageError naming the part) when
    it is not an image of a readable format, has too many pixels or too long a side ratio."""
    from PIL import Image  # Pillow: the `vision` extra

    sizes = []
    for ref in split.images:
        source = ref.source
        try:
            if isinstance(source, bytes | Path):
                with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source, formats=FORMATS) as image:
                    size = image.size
            else:
                size = source.size  # a PIL image
        except Image.DecompressionBombError as e:
            raise PromptImageError(ref.message_index, ref.part_index, f"too many pixels ({e})") from None
        except (OSError, SyntaxError, ValueError) as e:  # UnidentifiedImageError is an OSError
            raise PromptImageError(
                ref.message_index, ref.part_index, f"not an image (readable formats: {', '.join(FORMATS)}): {e}"
            ) from None
        width, height = size
        if width < 1 or height < 1 or width * height > limits.max_image_pixels:
            raise PromptImageError(
                ref.message_index,
                ref.part_index,
                f"the image is {width}x{height} pixels; at most {limits.max_image_pixels:,} pixels (max_image_pixels)",
            )
        if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            raise PromptImageError(
                ref.message_index,
                ref.part_index,
                f"the image is {width}x{height}: a side ratio over {MAX_ASPECT_RATIO}",
            )
        sizes.append((width, height))
    return sizes


def load_prompt_images(
    split: SplitMessages,
    config: VisionPreprocessConfig = QWEN3_VL,
    limits: ImageLimits = DEFAULT_LIMITS,
    *,
    device: torch.device | str | None = None,
) -> VisionInputs | None:
    """The images decoded and preprocessed, concatenated in prompt order (None when there are none).
    Every header is checked (probe_images) before any image is decoded."""
    decoded = decode_prompt_images(split, config, limits)
    return None if decoded is None else preprocess_decoded(decoded, config, device=device)


def decode_prompt_images(
    split: SplitMessages, config: VisionPreprocessConfig = QWEN3_VL, limits: ImageLimits = DEFAULT_LIMITS
) -> DecodedImages | None:
    """The images decoded and hashed on the host, in prompt order, for preprocessing where the
    encoder runs (preprocess_decoded; None when there are none). Every header is checked
    (probe_images) before any image is decoded; a refusal names the part."""
    if not split.images:
        return None
    probe_images(split, limits)
    pixels, digests, grids = [], [], []
    for ref in split.images:
        try:
            image = load_image(ref.source, max_pixels=limits.max_image_pixels, max_bytes=limits.max_image_bytes)
            one = decode_images([image], config, max_image_pixels=limits.max_image_pixels)
        except ImageInputError as e:
            raise PromptImageError(ref.message_index, ref.part_index, str(e)) from None
        pixels += one.pixels
        digests += one.digests
        grids.append(one.image_grid_thw)
    return DecodedImages(tuple(pixels), tuple(digests), torch.cat(grids))


def image_token_counts(grids: torch.Tensor | Sequence[Sequence[int]], merge: int) -> list[int]:
    """Tokens per image: t * h * w / merge², each grid checked (positive, h and w multiples of merge)."""
    rows = grids.tolist() if isinstance(grids, torch.Tensor) else [list(g) for g in grids]
    counts = []
    for index, row in enumerate(rows):
        if len(row) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in row):
            raise ValueError(f"image {index}: grid_thw must be three positive integers, got {row}")
        t, h, w = row
        if h % merge or w % merge:
            raise ValueError(f"image {index}: grid {row} has a side not a multiple of spatial_merge_size {merge}")
        counts.append(t * h * w // (merge * merge))
    return counts


def expand_image_tokens(
    ids: Sequence[int] | torch.Tensor, grids: torch.Tensor | Sequence[Sequence[int]], tokens: VisionTokenConfig
) -> list[int]:
    """`ids` with the i-th image token repeated image_token_counts(grids)[i] times. Each image must be
    one token (the placeholder's, not yet expanded), after vision_start when the config names one."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    counts = image_token_counts(grids, tokens.spatial_merge_size)
    image = tokens.image_token_id
    at = [i for i, token in enumerate(ids) if token == image]
    if len(at) != len(counts):
        raise ValueError(
            f"the prompt holds {len(at)} image tokens (id {image}) for {len(counts)} images: each image is one "
            "<|image_pad|> before expansion (is the tokenizer's <|image_pad|> the config's image_token_id?)"
        )
    start = tokens.vision_start_token_id
    out: list[int] = []
    previous = 0
    for index, (position, count) in enumerate(zip(at, counts, strict=True)):
        if start is not None and (position == 0 or ids[position - 1] != start):
            raise ValueError(
                f"image {index}: its token at position {position} does not follow vision_start ({start}); "
                "already expanded, or not written by the placeholder?"
            )
        out += ids[previous:position]
        out += [image] * count
        previous = position + 1
    out += ids[previous:]
    return out


def expand_video_tokens(
    ids: Sequence[int] | torch.Tensor,
    videos: VideoInputs,
    tokens: VisionTokenConfig,
    encode: Callable[[str], list[int]],
) -> list[int]:
    """`ids` with the i-th video token (the placeholder's `<|vision_start|><|video_pad|><|vision_end|>`)
    replaced as Qwen3VLProcessor replaces it: for each of the video's frame groups, the ids of
    `<{t:.1f} seconds>` (`encode`), vision_start, h * w / merge² video tokens, vision_end (the
    placeholder's own start and end stay around them). Each timestamp sits between special tokens in
    the processor's text, so tokenizing it alone gives the same ids."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    video = tokens.video_token_id
    if video is None:
        raise ValueError("the vision token config has no video_token_id")
    at = [i for i, token in enumerate(ids) if token == video]
    grids = videos.video_grid_thw.tolist()
    if len(at) != len(grids) or len(videos.timestamps) != len(grids):
        raise ValueError(
            f"the prompt holds {len(at)} video tokens (id {video}) for {len(grids)} videos: each video is one "
            "<|video_pad|> before expansion"
        )
    marks = {tokens.image_token_id, video, tokens.vision_start_token_id}
    merge = tokens.spatial_merge_size
    out: list[int] = []
    previous = 0
    for index, (position, grid, stamps) in enumerate(zip(at, grids, videos.timestamps, strict=True)):
        start = ids[position - 1] if position else None
        if start is None or (tokens.vision_start_token_id is not None and start != tokens.vision_start_token_id):
            raise ValueError(f"video {index}: its token at position {position} does not follow vision_start")
        if position + 1 == len(ids) or ids[position + 1] in marks:
            raise ValueError(f"video {index}: its token at position {position} is not followed by vision_end")
        end = ids[position + 1]
        if len(stamps) != grid[0]:
            raise ValueError(f"video {index}: {len(stamps)} timestamps for {grid[0]} frame groups")
        out += ids[previous:position]
        for seconds in stamps:
            text = encode(timestamp_text(seconds))
            if marks.intersection(text):
                raise ValueError(f"video {index}: the timestamp {timestamp_text(seconds)!r} encodes to vision tokens")
            out += [*text, start, *[video] * (grid[1] * grid[2] // (merge * merge)), end]
        previous = position + 1
    out += ids[previous:]
    return out


def encode_prompt(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer,
    tokens: VisionTokenConfig,
    config: VisionPreprocessConfig = QWEN3_VL,
    limits: ImageLimits = DEFAULT_LIMITS,
    *,
    device: torch.device | str | None = None,
    add_generation_prompt: bool = True,
    video_config: VideoPreprocessConfig | None = None,
    **template_kwargs: Any,
) -> MultimodalPrompt:
    """Messages (content parts with images and videos) → expanded token ids, the images' VisionInputs
    and the videos' VideoInputs (`video_config`, default VideoPreprocessConfig.like_images(config)).
    `add_vision_id` among template_kwargs labels them ("Picture n: ", "Video n: "), as Qwen3-VL's
    template."""
    add_vision_id = bool(template_kwargs.pop("add_vision_id", False))
    split = split_images(messages, limits, add_vision_id=add_vision_id, videos=True)
    vision = load_prompt_images(split, config, limits, device=device)
    videos = None
    if split.videos:
        video_config = video_config if video_config is not None else VideoPreprocessConfig.like_images(config)
        parts = []
        for ref in split.videos:
            try:
                parts.append(preprocess_videos([ref.source], video_config, device=device))
            except ImageInputError as e:
                raise PromptImageError(ref.message_index, ref.part_index, str(e)) from None
        videos = VideoInputs(
            torch.cat([part.pixel_values for part in parts]),
            torch.cat([part.video_grid_thw for part in parts]),
            tuple(stamps for part in parts for stamps in part.timestamps),
            tuple(digest for part in parts for digest in part.digests),
        )
    ids = tokenizer.encode_chat(list(split.messages), add_generation_prompt, **template_kwargs)
    grids = vision.image_grid_thw if vision is not None else []
    ids = expand_image_tokens(ids, grids, tokens)
    if videos is not None:
        ids = expand_video_tokens(ids, videos, tokens, tokenizer.encode)
    return MultimodalPrompt(ids, vision, split.messages, split.images, videos)
