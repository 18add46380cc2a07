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
from qruntime.vision.prompt_images import expand_image_tokens, image_token_counts

Encoder = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (pixel_values, grid_thw) -> [tokens, width]


@dataclass(frozen=True)
class VisionModel:
    """What the engine needs of a Qwen3-VL artifact's vision side."""

    encoder: Encoder  # the vision graph (qruntime.vision.encoder): one row per image token
    tokens: VisionTokenConfig
    preprocess: VisionPreprocessConfig
    width: int  # (1 + D) * hidden: an image token's embedding and its D DeepStack features
    limits: ImageLimits = ImageLimits()


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
) -> RequestImages:
    """The RequestImages of a prompt whose image tokens are expanded (one run per image, as
    prompt_images.expand_image_tokens writes them); `vision` None: a text prompt (positions equal on
    the three axes). A prompt whose runs disagree with the grids is a ValueError naming the image.
    The prefix cache's keys: `digests` (one per image), else `vision.digests` (the decoded pixels'
    sha256, preprocess.py), else each image's pixel_values hashed (image_digest; on a GPU that copies
    them to the host); none unless `keyed`."""
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
    """A prompt with images for a Qwen3-VL engine: text (or token ids) holding, for each image in
    order, one `<|vision_start|><|image_pad|><|vision_end|>` (prompt.IMAGE_PLACEHOLDER), which the
    engine expands to the image's tokens; images as load_image takes them (PIL image, path, bytes,
    base64 or a data URL)."""

    prompt: str | Sequence[int]
    images: Sequence[object]


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt checked and turned into token ids (image tokens expanded) and its images' state."""

    token_ids: list[int]
    images: RequestImages | None = None


def image_prompt_ids(
    prompt: ImagePrompt, model: VisionModel, encode: Callable[[str], list[int]], device: torch.device
) -> tuple[list[int], VisionInputs | None]:
    """An ImagePrompt's token ids with each image's tokens expanded, and its images preprocessed on
    `device` (ImageInputError names the image at fault; ValueError a placeholder count that is off)."""
    if len(prompt.images) > model.limits.max_images:
        raise ValueError(f"{len(prompt.images)} images, more than the limit of {model.limits.max_images}")
    ids = encode(prompt.prompt) if isinstance(prompt.prompt, str) else list(prompt.prompt)
    if not prompt.images:
        return ids, None
    limits = model.limits
    images = [
        load_image(i, max_pixels=limits.max_image_pixels, max_bytes=limits.max_image_bytes) for i in prompt.images
    ]
    vision = preprocess_images(images, model.preprocess, device=device, max_image_pixels=limits.max_image_pixels)
    return expand_image_tokens(ids, vision.image_grid_thw, model.tokens), vision
