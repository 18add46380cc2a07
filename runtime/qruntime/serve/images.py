"""Chat requests' images for a served Qwen3-VL model: OpenAI `image_url` parts (data URLs) → the
engine's token ids (each image's tokens expanded) and pixel values, on the HTTP side.

The order bounds the work a bad request can cause: the parts are split out and every image's header
read (qruntime.vision.prompt.split_images, prompt_images.probe_images: count, bytes, format, pixels,
no pixel decoded); the prompt is rendered and its length with the images' tokens, known from their
sizes, held to max_model_len; only then are the images decoded and hashed (on the request's worker
thread, never the engine's), and the engine resizes and patchifies them on its device (a 1920x1080
image took 0.13-0.2 s to preprocess on a CPU core here, ~6 ms on an H100). Every refusal is a 400
naming messages[i].content[j].

A client's image is never a local path or a file:// URL, and remote URLs are refused (nothing here
fetches them); `server_image_limits` sets that, with the server's --max-images-per-request and
--max-image-bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from qruntime.serve.errors import invalid
from qruntime.vision.decode import DEFAULT_MAX_IMAGE_PIXELS, ImageInputError
from qruntime.vision.positions import VisionTokenConfig
from qruntime.vision.preprocess import DecodedImages, VisionPreprocessConfig, smart_resize
from qruntime.vision.prompt import DEFAULT_LIMITS, ImageLimits, PromptImageError, SplitMessages, split_images
from qruntime.vision.prompt_images import decode_prompt_images, expand_image_tokens, probe_images

DEFAULT_MAX_IMAGES = 16  # --max-images-per-request
DEFAULT_MAX_IMAGE_BYTES = 16 << 20  # --max-image-bytes


def server_image_limits(
    max_images: int = DEFAULT_MAX_IMAGES,
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> ImageLimits:
    """What a client's images may be: no local files, no remote URLs; the request's total bytes at
    least one image's (ImageLimits' 64 MiB otherwise). ValueError names a limit below 1."""
    return ImageLimits(
        max_images=max_images,
        max_image_bytes=max_image_bytes,
        max_total_bytes=max(DEFAULT_LIMITS.max_total_bytes, max_image_bytes),
        max_image_pixels=max_image_pixels,
        allow_remote_urls=False,
        allow_local_files=False,
    )


@dataclass(frozen=True)
class ServedVision:
    """A Qwen3-VL model's image settings, as the HTTP side needs them (no encoder: picklable, so an
    engine process can send them): its image token ids, its preprocessing and the limits on images."""

    tokens: VisionTokenConfig
    preprocess: VisionPreprocessConfig
    limits: ImageLimits

    @classmethod
    def of(cls, vision: Any) -> ServedVision | None:
        """From an engine's VisionModel (or anything with tokens / preprocess / limits); None for None."""
        if vision is None:
            return None
        return cls(vision.tokens, vision.preprocess, vision.limits)

    def for_clients(self, max_images: int, max_image_bytes: int) -> ServedVision:
        """The same model, its limits the server's (server_image_limits; the model's pixel bound kept)."""
        return replace(self, limits=server_image_limits(max_images, max_image_bytes, self.limits.max_image_pixels))


@dataclass(frozen=True)
class ChatImages:
    """A chat request's messages with each image part a placeholder, its images, and their tokens."""

    split: SplitMessages
    token_counts: tuple[int, ...]  # image tokens of each image, from its header's size


def has_image_parts(body: Any) -> bool:
    """Whether a chat body holds a content part that is not text (a cheap look, before parsing)."""
    messages = body.get("messages") if isinstance(body, Mapping) else None
    if not isinstance(messages, list):
        return False
    return any(
        isinstance(m, Mapping)
        and isinstance(m.get("content"), list)
        and any(not (isinstance(p, Mapping) and p.get("type") == "text") for p in m["content"])
        for m in messages
    )


def split_chat_images(messages: Sequence[Any], vision: ServedVision, *, add_vision_id: bool = False) -> ChatImages:
    """Each content list → text with Qwen3-VL's image placeholders, the images taken out and their
    headers read (nothing decoded): a 400 naming the part for a bad or oversized one."""
    try:
        split = split_images(messages, vision.limits, add_vision_id=add_vision_id)
        sizes = probe_images(split, vision.limits)
        counts = tuple(image_tokens(width, height, vision.preprocess) for width, height in sizes)
    except ImageInputError as exc:  # PromptImageError included: it names messages[i].content[j]
        raise invalid("messages", str(exc)) from None
    return ChatImages(split, counts)


def image_tokens(width: int, height: int, config: VisionPreprocessConfig) -> int:
    """The tokens an image of width x height pixels becomes (preprocess.py's resize and patches)."""
    if config.do_resize:
        height, width = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    return (height // config.patch_size) * (width // config.patch_size) // (config.merge_size**2)


def load_chat_images(images: ChatImages, vision: ServedVision) -> DecodedImages | None:
    """The images decoded and hashed on the CPU, in prompt order (None without images); the engine
    resizes and patchifies them on its device (preprocess_decoded)."""
    try:
        return decode_prompt_images(images.split, vision.preprocess, vision.limits)
    except PromptImageError as exc:
        raise invalid("messages", str(exc)) from None
    except ValueError as exc:  # ImageInputError not tied to a part, or a preprocessing refusal
        raise invalid("messages", f"the images cannot be used: {exc}") from None


def expand_chat_ids(ids: list[int], inputs: DecodedImages | None, vision: ServedVision) -> list[int]:
    """The rendered prompt's ids with each image's placeholder token repeated for its image's tokens."""
    grids = inputs.image_grid_thw if inputs is not None else []
    try:
        return expand_image_tokens(ids, grids, vision.tokens)
    except ValueError as exc:
        raise invalid("messages", f"the rendered prompt does not place the images: {exc}") from None


def check_no_vision_tokens(ids: Sequence[int], vision: ServedVision, param: str) -> None:
    """A 400 for a prompt given as text or ids that holds image or video tokens: they need images,
    which only chat messages' image parts bring."""
    marks = {vision.tokens.image_token_id, vision.tokens.video_token_id}
    for position, token in enumerate(ids):
        if token in marks:
            raise invalid(
                param,
                f"{param}: token {token} at position {position} is an image or video token; send images as "
                "image_url parts of /v1/chat/completions messages",
            )
