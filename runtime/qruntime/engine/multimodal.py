"""A request's images in the engine (Qwen3-VL): its prompt's M-RoPE positions, which of its prompt
tokens are image tokens, and their vision embeddings once the encoder has run; what each step chunk
of it carries (StepChunk.mrope / vision_rows / vision_embeds).

The vision encoder runs once per image, when the request's first chunk holding image tokens is
scheduled, for every such request of the step in one call (`encode_pending`): images are batched
across requests. Its output stays with the request until it finishes (a preempted request computes
its prompt again from the same embeddings).

The prefix cache names blocks by their tokens, and every image token is the same id: `image_keys`
gives, per image, the prompt position of its first token and a digest of its decoded pixels, which
the scheduler mixes into the hash chain at that block (prefix_cache.extend_chain), so a block is
found again only after the same images at the same places.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from qruntime.vision.decode import load_image
from qruntime.vision.positions import VisionTokenConfig, mrope_positions
from qruntime.vision.preprocess import VisionInputs, VisionPreprocessConfig, preprocess_images
from qruntime.vision.prompt import ImageLimits
from qruntime.vision.prompt_images import expand_image_tokens, expand_video_tokens, image_token_counts
from qruntime.vision.video import Video, VideoInputs, VideoPreprocessConfig, preprocess_videos

Encoder = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (pixel_values, grid_thw) -> [tokens, width]


@dataclass(frozen=True)
class VisionModel:
    """What the engine needs of a Qwen3-VL artifact's vision side."""

    encoder: Encoder  # the vision graph (qruntime.vision.encoder): one row per image token
    tokens: VisionTokenConfig
    preprocess: VisionPreprocessConfig
    width: int  # (1 + D) * hidden: an image token's embedding and its D DeepStack features
    limits: ImageLimits = ImageLimits()
    video: VideoPreprocessConfig | None = None  # manifest vision.video_preprocessor; None: like_images(preprocess)

    @property
    def video_config(self) -> VideoPreprocessConfig:
        """How videos are sampled and preprocessed: the artifact's vision.video_preprocessor (the
        loader sets `video`), else transformers' Qwen3VLVideoProcessor defaults with the image config's
        patch layout."""
        return self.video if self.video is not None else VideoPreprocessConfig.like_images(self.preprocess)


@dataclass(eq=False)
class RequestImages:
    """One request's images: prompt positions, image rows, and (once encoded) their embeddings."""

    positions: np.ndarray  # [3, prompt] int64: the prompt's M-RoPE positions
    delta: int  # a token after the prompt sits at its index + delta on all three axes
    rows: np.ndarray  # [N] int64: the prompt's image-token positions, ascending
    inputs: VisionInputs | None  # the images' patches until encoded (then dropped)
    keys: tuple[tuple[int, bytes], ...]  # (first token position, digest) per image: prefix cache names
    embeds: torch.Tensor | None = None  # [N, width] on the engine's device, once encoded

    def needs_encoder(self, start: int, end: int) -> bool:
        """Whether tokens [start, end) hold an image token whose embedding is not computed yet."""
        if self.embeds is not None or not self.rows.size:
            return False
        first = int(np.searchsorted(self.rows, start))
        return first < self.rows.size and int(self.rows[first]) < end

    def chunk_parts(
        self, start: int, end: int
    ) -> tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], tuple[int, ...], torch.Tensor | None]:
        """StepChunk's (mrope, vision_rows, vision_embeds) for the request's tokens [start, end): the
        prompt's positions, then index + delta past it; the chunk-relative rows of its image tokens and
        their embeddings (None when it holds none)."""
        prompt = self.positions.shape[1]
        head = self.positions[:, min(start, prompt) : min(end, prompt)]
        tail = np.arange(max(start, prompt), max(end, prompt), dtype=np.int64) + self.delta
        mrope = np.concatenate([head, np.broadcast_to(tail, (3, tail.size))], axis=1)
        lo, hi = np.searchsorted(self.rows, start), np.searchsorted(self.rows, end)
        if lo == hi:
            return _rows3(mrope), (), None
        if self.embeds is None:
            raise ValueError("the chunk holds image tokens whose embeddings were not computed (encode_pending first)")
        return _rows3(mrope), tuple((self.rows[lo:hi] - start).tolist()), self.embeds[lo:hi]


def _rows3(positions: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    t, h, w = positions.tolist()
    return tuple(t), tuple(h), tuple(w)


def request_images(
    token_ids: Sequence[int],
    vision: VisionInputs | None,
    tokens: VisionTokenConfig,
    digests: Sequence[bytes] | None = None,
    keyed: bool = True,
    videos: VideoInputs | None = None,
) -> RequestImages:
    """The RequestImages of a prompt whose image tokens are expanded (one run per image, as
    prompt_images.expand_image_tokens writes them); `vision` None: a text prompt (positions equal on
    the three axes). A prompt whose runs disagree with the grids is a ValueError naming the image.
    The prefix cache's keys: `digests` (one per image), else `vision.digests` (the decoded pixels'
    sha256, preprocess.py), else each image's pixel_values hashed (image_digest; on a GPU that copies
    them to the host); none unless `keyed`. `videos`: the prompt's videos (their tokens expanded per
    frame group, prompt_images.expand_video_tokens); with them the images and videos become one list
    of vision items in prompt order (`merge_videos`), each keyed by its first token."""
    if videos is not None:
        return merge_videos(token_ids, vision, videos, tokens, digests, keyed)
    grids = vision.image_grid_thw if vision is not None else None
    mrope = mrope_positions(token_ids, tokens, grids)
    ids = np.asarray(token_ids, dtype=np.int64)
    rows = np.flatnonzero(ids == tokens.image_token_id).astype(np.int64)
    counts = tuple(image_token_counts(grids, tokens.spatial_merge_size)) if grids is not None else ()
    if sum(counts) != rows.size:  # mrope_positions checked the runs; a stray image token is not one
        raise ValueError(f"the prompt holds {rows.size} image tokens for images of {sum(counts)} tokens")
    keys: list[tuple[int, bytes]] = []
    if vision is not None and keyed:
        digests = digests if digests is not None else (vision.digests or None)
        if digests is not None and len(digests) != len(counts):
            raise ValueError(f"{len(digests)} image digests for {len(counts)} images")
        offset, first = 0, 0
        pixels = vision.pixel_values
        for index, (count, grid) in enumerate(zip(counts, vision.image_grid_thw.tolist(), strict=True)):
            patches = grid[0] * grid[1] * grid[2]
            digest = digests[index] if digests is not None else image_digest(pixels[offset : offset + patches], grid)
            keys.append((int(rows[first]), digest))
            offset, first = offset + patches, first + count
    return RequestImages(mrope.positions.numpy(), mrope.delta, rows, vision, tuple(keys))


def merge_videos(
    token_ids: Sequence[int],
    vision: VisionInputs | None,
    videos: VideoInputs,
    tokens: VisionTokenConfig,
    digests: Sequence[bytes] | None,
    keyed: bool,
) -> RequestImages:
    """request_images of a prompt with videos: rows are every image and video token, and the inputs
    the images' and videos' patches in the order their first tokens come (the encoder's output rows
    then follow the rows: a video's frames are its tokens in order, and the tower treats a video as an
    image of t > 1 frames, which transformers' get_video_features is)."""
    grids = vision.image_grid_thw if vision is not None else None
    mrope = mrope_positions(token_ids, tokens, grids, videos.video_grid_thw)
    ids = np.asarray(token_ids, dtype=np.int64)
    image_rows = np.flatnonzero(ids == tokens.image_token_id)
    video_rows = np.flatnonzero(ids == tokens.video_token_id)
    rows = np.flatnonzero((ids == tokens.image_token_id) | (ids == tokens.video_token_id)).astype(np.int64)
    merge = tokens.spatial_merge_size
    items = []  # (first token, pixel rows, grid, digest)
    for kind, inputs, kind_rows in (("image", vision, image_rows), ("video", videos, video_rows)):
        if inputs is None:
            if kind_rows.size:
                raise ValueError(f"the prompt holds {kind_rows.size} {kind} tokens but no {kind}s")
            continue
        kind_grids = inputs.image_grid_thw if kind == "image" else inputs.video_grid_thw
        counts = image_token_counts(kind_grids, merge)
        if sum(counts) != kind_rows.size:
            raise ValueError(f"the prompt holds {kind_rows.size} {kind} tokens for {kind}s of {sum(counts)} tokens")
        given = (digests if kind == "image" else None) or inputs.digests or None
        if given is not None and len(given) != len(counts):
            raise ValueError(f"{len(given)} {kind} digests for {len(counts)} {kind}s")
        offset, first = 0, 0
        for index, (count, grid) in enumerate(zip(counts, kind_grids.tolist(), strict=True)):
            patches = grid[0] * grid[1] * grid[2]
            pixels = inputs.pixel_values[offset : offset + patches]
            digest = given[index] if given is not None else (image_digest(pixels, grid) if keyed else b"")
            items.append((int(kind_rows[first]), pixels, grid, digest))
            offset, first = offset + patches, first + count
    items.sort(key=lambda item: item[0])
    device = items[0][1].device
    merged = VisionInputs(
        torch.cat([item[1] for item in items]),
        torch.tensor([item[2] for item in items], dtype=torch.int64, device=device),
        tuple(item[3] for item in items),
    )
    keys = tuple((item[0], item[3]) for item in items) if keyed else ()
    return RequestImages(mrope.positions.numpy(), mrope.delta, rows, merged, keys)


def image_digest(pixel_values: torch.Tensor, grid: Sequence[int]) -> bytes:
    """sha256 of one image's patches (their bytes, dtype and shape) and grid: equal only for the same
    pixels at the same size."""
    data = pixel_values.detach().contiguous().cpu()
    head = f"pixel_values|{data.dtype}|{tuple(data.shape)}|{tuple(int(v) for v in grid)}|".encode()
    return hashlib.sha256(head + data.view(torch.uint8).numpy().tobytes()).digest()


def encode_pending(pending: Sequence[RequestImages], model: VisionModel, device: torch.device) -> None:
    """Run the encoder once over every image of `pending` (requests whose embeddings are not computed)
    and give each request its rows; their patches are dropped."""
    todo = [r for r in pending if r.embeds is None and r.inputs is not None]
    if not todo:
        return
    pixels = torch.cat([r.inputs.pixel_values.to(device) for r in todo])
    grids = torch.cat([r.inputs.image_grid_thw for r in todo])
    out = model.encoder(pixels, grids)  # [sum of tokens, width]
    if out.shape != (sum(r.rows.size for r in todo), model.width):
        raise ValueError(
            f"the vision encoder gave {tuple(out.shape)} for {sum(r.rows.size for r in todo)} image tokens "
            f"of width {model.width}"
        )
    start = 0
    for r in todo:
        r.embeds, r.inputs = out[start : start + r.rows.size], None
        start += r.rows.size


def step_images(
    chunks: Sequence[object],
    images_of: Callable[[str], RequestImages | None],
    model: VisionModel,
    device: torch.device,
) -> dict[str, RequestImages]:
    """The images of a step's requests that have any (request id -> images), each one's embeddings
    computed first if its chunk reaches an image token: one encoder call for all of them.
    `chunks`: the scheduler's chunks (request, start, num_tokens)."""
    images: dict[str, RequestImages] = {}
    pending = []
    for chunk in chunks:
        request_id = chunk.request.request_id  # type: ignore[attr-defined]
        state = images_of(request_id)
        if state is None:
            continue
        images[request_id] = state
        if state.needs_encoder(chunk.start, chunk.start + chunk.num_tokens):  # type: ignore[attr-defined]
            pending.append(state)
    encode_pending(pending, model, device)
    return images


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images (and videos) for a Qwen3-VL engine: text (or token ids) holding, for each
    image in order, one `<|vision_start|><|image_pad|><|vision_end|>` (prompt.IMAGE_PLACEHOLDER), which
    the engine expands to the image's tokens; images as load_image takes them (PIL image, path, bytes,
    base64 or a data URL). Each video (`vision.video.Video`: frames and their fps) is one
    `<|vision_start|><|video_pad|><|vision_end|>` (prompt.VIDEO_PLACEHOLDER), expanded as
    transformers' Qwen3VLProcessor does: per frame group `<t seconds>`, vision_start, its tokens,
    vision_end."""

    prompt: str | Sequence[int]
    images: Sequence[object]
    videos: Sequence[Video] = ()


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt checked and turned into token ids (image tokens expanded) and its images' state."""

    token_ids: list[int]
    images: RequestImages | None = None


def image_prompt_ids(
    prompt: ImagePrompt, model: VisionModel, encode: Callable[[str], list[int]], device: torch.device
) -> tuple[list[int], VisionInputs | None, VideoInputs | None]:
    """An ImagePrompt's token ids with each image's and video's tokens expanded (the timestamps
    tokenized by `encode`), and its images and videos preprocessed on `device` (ImageInputError names
    the image or video at fault; ValueError a placeholder count that is off). Videos count toward
    limits.max_images."""
    videos = list(prompt.videos)
    if len(prompt.images) + len(videos) > model.limits.max_images:
        raise ValueError(
            f"{len(prompt.images)} images and {len(videos)} videos, more than the limit of {model.limits.max_images}"
        )
    ids = encode(prompt.prompt) if isinstance(prompt.prompt, str) else list(prompt.prompt)
    vision = video_inputs = None
    if prompt.images:
        limits = model.limits
        images = [
            load_image(i, max_pixels=limits.max_image_pixels, max_bytes=limits.max_image_bytes) for i in prompt.images
        ]
        vision = preprocess_images(images, model.preprocess, device=device, max_image_pixels=limits.max_image_pixels)
        ids = expand_image_tokens(ids, vision.image_grid_thw, model.tokens)
    if videos:
        for index, video in enumerate(videos):
            if not isinstance(video, Video):
                raise ValueError(
                    f"video {index}: a qruntime.vision.video.Video (frames, fps), got {type(video).__name__}"
                )
        video_inputs = preprocess_videos(videos, model.video_config, device=device)
        ids = expand_video_tokens(ids, video_inputs, model.tokens, encode)
    return ids, vision, video_inputs
