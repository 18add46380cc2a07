"""Chat messages with images → Qwen3-VL's prompt text and the images it names, bounded.

OpenAI-style messages may carry `content` as a list of parts:
- `{"type": "text", "text": str}`;
- `{"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": ...}}`
  (`detail` is kept and not used: Qwen3-VL's resolution comes from min / max_pixels);
- `{"type": "image", "image": <PIL image | bytes | path | data URL | base64 str>}` (the Python API).

`split_images` returns the messages with each content list turned into a string, each image part
becoming Qwen3-VL's placeholder `<|vision_start|><|image_pad|><|vision_end|>` where it was, the text
parts joined around it with nothing between: what the Qwen3-VL checkpoints' own chat template writes
for a user or tool message's parts (their template writes a system or assistant message's text parts
alone and drops its images, so images there are refused rather than lost). The string content then
renders through any template, qruntime's Tokenizer included. The images come back in prompt order
as `ImageRef`s, their encoded bytes already taken out of data URLs / base64.

Limits (`ImageLimits`): images per request, encoded bytes per image and in total, decoded pixels per
image (checked from the header, prompt_images.py). Remote http(s) URLs are refused (fetching is not
supported: there is no network client here); local paths only when `allow_local_files` (the Python
API's default; the server turns it off). Every refusal is a `PromptImageError` naming the message
and part. The work is linear in the input and no image is decoded here.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qruntime.shown import shown
from qruntime.vision.decode import DEFAULT_MAX_IMAGE_PIXELS, ImageInputError, ImageSource

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # one image, before expansion
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"  # one video, before expansion
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
IMAGE_ROLES = ("user", "tool")  # the roles whose image parts Qwen3-VL's template renders
DETAILS = ("auto", "low", "high")  # OpenAI's image_url.detail values
MAX_PATH_CHARS = 4096


class PromptImageError(ImageInputError):
    """An image part (or the text around one) that cannot be used, with where it is: `message_index`
    and `part_index` (None when the message's content as a whole is at fault)."""

    def __init__(self, message_index: int, part_index: int | None, problem: str) -> None:
        self.message_index, self.part_index, self.problem = message_index, part_index, problem
        super().__init__(f"{where(message_index, part_index)}: {problem}")


def where(message_index: int, part_index: int | None) -> str:
    """How errors name a part: messages[i].content[j]."""
    part = "" if part_index is None else f"[{part_index}]"
    return f"messages[{message_index}].content{part}"


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be. Bytes are the encoded image's (a data URL's base64 counted
    as the bytes it decodes to); pixels are width * height of the decoded image, read from its header."""

    max_images: int = 16
    max_image_bytes: int = 16 << 20
    max_total_bytes: int = 64 << 20
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allow_remote_urls: bool = False  # even when on, fetching is not supported yet: refused as such
    allow_local_files: bool = True  # paths and file:// URLs (never for a server's clients)

    def __post_init__(self) -> None:
        for key in ("max_images", "max_image_bytes", "max_total_bytes", "max_image_pixels"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"image limits: {key} must be a positive integer, got {shown(value)}")
        for key in ("allow_remote_urls", "allow_local_files"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"image limits: {key} must be true or false, got {shown(getattr(self, key))}")


DEFAULT_LIMITS = ImageLimits()


@dataclass(frozen=True)
class ImageRef:
    """One image of the prompt: where it was and what to decode (bytes, a PIL image, or a Path)."""

    message_index: int
    part_index: int
    source: ImageSource
    detail: str | None = None

    @property
    def where(self) -> str:
        return where(self.message_index, self.part_index)


@dataclass(frozen=True)
class SplitMessages:
    """`messages` with string (or None) contents, images as IMAGE_PLACEHOLDER; `images` in order."""

    messages: tuple[dict[str, Any], ...]
    images: tuple[ImageRef, ...]
    videos: tuple[ImageRef, ...] = ()  # sources are vision.video.Video (frames and their fps)


def split_images(
    messages: Sequence[Mapping[str, Any]],
    limits: ImageLimits = DEFAULT_LIMITS,
    *,
    add_vision_id: bool = False,
    videos: bool = False,
) -> SplitMessages:
    """Each content list → a string with the image placeholders, and the images. `add_vision_id`
    writes "Picture n: " before the n-th image's placeholder, as the template's variable of that
    name does. With `videos`, a part `{"type": "video", "video": [frames...], "fps": rate}` (optional
    "sample_fps" or "num_frames") becomes VIDEO_PLACEHOLDER ("Video n: " before it with
    add_vision_id) and a Video; without, such a part is refused. Videos count toward max_images.
    Raises PromptImageError naming the message and part."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ImageInputError(f"messages must be a list of {{role, content}} mappings, got {shown(messages)}")
    out: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    video_refs: list[ImageRef] = []
    total = [0]  # encoded bytes so far
    for m, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PromptImageError(m, None, f"a message is a mapping with role and content, got {shown(message)}")
        content = message.get("content")
        if isinstance(content, str):
            _check_text(content, m, None)
        elif isinstance(content, list):
            pieces = []
            for p, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind == "text":
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise PromptImageError(m, p, f"a text part's text must be a string, got {shown(text)}")
                    _check_text(text, m, p)
                    pieces.append(text)
                    continue
                if kind == "video" and not videos:
                    raise PromptImageError(
                        m,
                        p,
                        "video parts are not taken by the server (videos go through the Python API: Engine.chat, ImagePrompt)",
                    )
                if kind not in ("image_url", "image", "video"):
                    raise PromptImageError(
                        m, p, f"a part is {{'type': 'text' | 'image_url' | 'image', ...}}, got {shown(part)}"
                    )
                if message.get("role") not in IMAGE_ROLES:
                    raise PromptImageError(
                        m, p, f"images are taken in user and tool messages only, not {shown(message.get('role'))}"
                    )
                if len(images) + len(video_refs) == limits.max_images:
                    raise PromptImageError(m, p, f"more than {limits.max_images} images in one request (max_images)")
                if kind == "video":
                    video_refs.append(ImageRef(m, p, _video_part(part, m, p)))
                    label = f"Video {len(video_refs)}: " if add_vision_id else ""
                    pieces.append(label + VIDEO_PLACEHOLDER)
                    continue
                images.append(_image_part(part, kind, m, p, limits, total))
                label = f"Picture {len(images)}: " if add_vision_id else ""
                pieces.append(label + IMAGE_PLACEHOLDER)
            content = "".join(pieces)
        elif content is not None:
            raise PromptImageError(m, None, f"content must be a string or a list of parts, got {shown(content)}")
        out.append({**message, "content": content})
    return SplitMessages(tuple(out), tuple(images), tuple(video_refs))


def _video_part(part: Mapping[str, Any], m: int, p: int) -> Any:
    """A video part's Video: its frames (PIL RGB images or [H, W, 3] uint8 arrays) and rate."""
    from qruntime.vision.video import Video

    extra = set(part) - {"type", "video", "fps", "sample_fps", "num_frames"}
    if "video" not in part or extra:
        raise PromptImageError(
            m, p, f"a video part is {{'type': 'video', 'video': [frames], 'fps': rate}}, got {shown(part)}"
        )
    if "fps" not in part:
        raise PromptImageError(m, p, "a video part needs its frames' rate: 'fps'")
    try:
        return Video(part["video"], part["fps"], part.get("sample_fps"), part.get("num_frames"))
    except ImageInputError as e:
        raise PromptImageError(m, p, str(e)) from None


def _check_text(text: str, m: int, p: int | None) -> None:
    for token in (IMAGE_PAD, VIDEO_PAD):
        if token in text:
            raise PromptImageError(
                m, p, f"the text holds {token}, which the tokenizer would read as a vision token; remove it"
            )


def _image_part(part: Mapping[str, Any], kind: str, m: int, p: int, limits: ImageLimits, total: list[int]) -> ImageRef:
    detail = None
    if kind == "image_url":
        value = part.get("image_url")
        if not isinstance(value, Mapping) or not isinstance(value.get("url"), str):
            raise PromptImageError(
                m, p, f"an image_url part is {{'type': 'image_url', 'image_url': {{'url': ...}}}}, got {shown(part)}"
            )
        detail = value.get("detail")
        if detail is not None and detail not in DETAILS:
            raise PromptImageError(m, p, f"image_url.detail must be one of {', '.join(DETAILS)}, got {shown(detail)}")
        source = _url(value["url"], m, p, limits)
    else:
        if "image" not in part:
            raise PromptImageError(m, p, f"an image part is {{'type': 'image', 'image': ...}}, got {shown(part)}")
        source = _image_value(part["image"], m, p, limits)
    size = _encoded_size(source, m, p)
    if size > limits.max_image_bytes:
        raise PromptImageError(
            m, p, f"the image is {size:,} bytes, over the limit of {limits.max_image_bytes:,} (max_image_bytes)"
        )
    total[0] += size
    if total[0] > limits.max_total_bytes:
        raise PromptImageError(
            m,
            p,
            f"the images so far hold {total[0]:,} bytes, over the limit of {limits.max_total_bytes:,} (max_total_bytes)",
        )
    return ImageRef(m, p, source, detail)


def _url(url: str, m: int, p: int, limits: ImageLimits) -> ImageSource:
    """image_url.url: a data URL, or (when allowed) a file:// URL."""
    scheme = url[: url.find(":")].lower() if ":" in url[:16] else ""
    if scheme == "data":
        return _data_url(url, m, p, limits)
    if scheme in ("http", "https"):
        _refuse_remote(url, m, p, limits)
    if scheme == "file":
        return _local(url[len("file://") :], m, p, limits)
    raise PromptImageError(m, p, f"image_url.url must be a data URL (data:image/png;base64,...), got {shown(url)}")


def _image_value(value: Any, m: int, p: int, limits: ImageLimits) -> ImageSource:
    """An image part's image: a PIL image, bytes, a path, a data URL or a base64 string."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, os.PathLike):
        return _local(value, m, p, limits)
    if isinstance(value, str):
        lowered = value[:16].lower()
        if lowered.startswith("data:"):
            return _data_url(value, m, p, limits)
        if lowered.startswith(("http://", "https://")):
            _refuse_remote(value, m, p, limits)
        if lowered.startswith("file://"):
            return _local(value[len("file://") :], m, p, limits)
        if limits.allow_local_files and len(value) < MAX_PATH_CHARS and os.path.isfile(value):
            return Path(value)
        return _b64(value, m, p, limits)
    if type(value).__module__.startswith("PIL."):
        return value  # a PIL image: checked and decoded by load_image
    raise PromptImageError(
        m, p, f"an image is a PIL image, bytes, a path, a data URL or base64, got {type(value).__name__}"
    )


def _refuse_remote(url: str, m: int, p: int, limits: ImageLimits) -> None:
    if limits.allow_remote_urls:
        raise PromptImageError(m, p, f"fetching remote image URLs is not supported: {shown(url)}; send a data URL")
    raise PromptImageError(
        m, p, f"remote image URLs are refused (allow_remote_urls is off): {shown(url)}; send a data URL instead"
    )


def _local(path: str | os.PathLike, m: int, p: int, limits: ImageLimits) -> Path:
    if not limits.allow_local_files:
        raise PromptImageError(m, p, f"local image files are not taken here: {shown(str(path))}; send a data URL")
    return Path(path)


def _data_url(url: str, m: int, p: int, limits: ImageLimits) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise PromptImageError(m, p, f"the data URL {shown(header)} has no ',' before its data")
    media_type, *params = header[len("data:") :].split(";")
    if not media_type.strip().lower().startswith("image/"):
        raise PromptImageError(m, p, f"the data URL's media type {shown(media_type)} is not image/...")
    if "base64" not in (param.strip().lower() for param in params):
        raise PromptImageError(m, p, f"the data URL {shown(header)} is not base64 (data:{media_type};base64,...)")
    return _b64(payload, m, p, limits)


def _b64(text: str, m: int, p: int, limits: ImageLimits) -> bytes:
    if len(text) // 4 * 3 > limits.max_image_bytes + 3:  # refused before decoding
        raise PromptImageError(
            m,
            p,
            f"the image is about {len(text) // 4 * 3:,} bytes, over the limit of {limits.max_image_bytes:,} (max_image_bytes)",
        )
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise PromptImageError(m, p, f"the image's base64 is not valid ({e})") from None


def _encoded_size(source: ImageSource, m: int, p: int) -> int:
    if isinstance(source, bytes):
        return len(source)
    if isinstance(source, Path):
        try:
            return source.stat().st_size
        except OSError as e:
            raise PromptImageError(m, p, f"the image file {shown(str(source))} cannot be read: {e.strerror}") from None
    return 0  # a PIL image: bounded by its pixels
