"""Images in: a PIL image, a file path, raw bytes, a base64 string or a data URL → one decoded PIL
image, bounded before its pixels are decoded.

Bounds: the encoded size (`max_bytes`) and the decoded pixel count (`max_pixels`), the latter read
from the image header, so a decompression bomb (a small file that decodes to gigapixels) is refused
before Pillow allocates it. Only raster formats are opened (`FORMATS`): Pillow's EPS plugin, for
one, would run Ghostscript on the bytes. Files decoded here are turned upright by their EXIF
orientation, as transformers' `load_image` does; a PIL image passed in is taken as it is (as
transformers' processor takes one).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Union

from qruntime.shown import shown

if TYPE_CHECKING:
    from PIL import Image

DEFAULT_MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # decoded width * height; 4x Qwen3-VL's own max_pixels
DEFAULT_MAX_IMAGE_BYTES = 64 * 1024 * 1024  # encoded size (file, bytes, or base64 once decoded)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")

ImageSource = Union["Image.Image", str, os.PathLike, bytes, bytearray, memoryview]


class ImageInputError(ValueError):
    """An image input that cannot be used: not an image, corrupt, too large, or of an unknown kind."""


def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError as e:  # pragma: no cover - pillow is installed wherever images are used
        raise ImportError("images need Pillow: pip install 'qcompile-runtime[vision]'") from e
    return Image, ImageOps


def load_image(
    source: ImageSource, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
) -> Image.Image:
    """Decode `source` into a PIL image (pixels loaded), refusing what is not an image or too large.

    `source`: a PIL image; a `pathlib.Path` or a string naming an existing file; bytes; a string of
    base64; or a data URL `data:image/<type>;base64,<data>`. http(s) URLs are refused: fetching is
    the caller's decision. Raises ImageInputError naming the input.
    """
    Image, ImageOps = _pil()
    if isinstance(source, Image.Image):
        _check_pixels(source.size, f"PIL image {source.mode} {source.size[0]}x{source.size[1]}", max_pixels)
        try:
            source.load()
        except (OSError, SyntaxError, ValueError) as e:
            raise ImageInputError(f"the PIL image passed in could not be decoded: {e}") from e
        return source
    data, label = _encoded_bytes(source, max_bytes)
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except Image.DecompressionBombError as e:
        raise ImageInputError(f"{label}: too many pixels ({e})") from e
    except (OSError, SyntaxError, ValueError) as e:  # UnidentifiedImageError is an OSError
        raise ImageInputError(f"{label} is not an image (readable formats: {', '.join(FORMATS)}): {e}") from e
    _check_pixels(image.size, label, max_pixels)
    try:
        image.load()
    except Image.DecompressionBombError as e:
        raise ImageInputError(f"{label}: too many pixels ({e})") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageInputError(f"{label} could not be decoded (truncated or corrupt?): {e}") from e
    return ImageOps.exif_transpose(image)


def _check_pixels(size: tuple[int, int], label: str, max_pixels: int) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ImageInputError(f"{label} has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise ImageInputError(
            f"{label} is {width}x{height} = {width * height:,} pixels, over the limit of {max_pixels:,} "
            "(max_pixels): downscale it first"
        )


def _encoded_bytes(source: ImageSource, max_bytes: int) -> tuple[bytes, str]:
    """The encoded image's bytes and a short label naming where they came from."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        _check_bytes(len(data), f"image bytes ({len(data):,} bytes)", max_bytes)
        return data, f"image bytes ({len(data):,} bytes)"
    if isinstance(source, os.PathLike):
        return _read_file(Path(source), max_bytes)
    if not isinstance(source, str):
        raise ImageInputError(
            f"an image is a PIL image, a path, bytes, a base64 string or a data URL; got {type(source).__name__}"
        )
    if source.startswith("data:"):
        return _data_url(source, max_bytes)
    if source.startswith(("http://", "https://")):
        raise ImageInputError(f"remote image URLs are not fetched here: {shown(source)}; pass the bytes instead")
    if len(source) < 4096 and os.path.isfile(source):
        return _read_file(Path(source), max_bytes)
    label = f"base64 image {shown(source)}"
    return _b64(source, label, max_bytes), label


def _read_file(path: Path, max_bytes: int) -> tuple[bytes, str]:
    label = f"image file {shown(str(path))}"
    try:
        size = path.stat().st_size
        _check_bytes(size, label, max_bytes)
        return path.read_bytes(), label
    except OSError as e:
        raise ImageInputError(f"{label} could not be read: {e}") from e


def _data_url(url: str, max_bytes: int) -> tuple[bytes, str]:
    header, comma, payload = url.partition(",")
    label = f"data URL {shown(header)}"
    media_type, *params = header[len("data:") :].split(";")
    if not comma:
        raise ImageInputError(f"{label} has no ',' before its data")
    if not media_type.lower().startswith("image/"):
        raise ImageInputError(
            f"{label}: media type {shown(media_type or '(none)')} is not an image; use data:image/<type>;base64,..."
        )
    if "base64" not in (p.strip().lower() for p in params):
        raise ImageInputError(f"{label} is not base64-encoded; use data:{media_type};base64,...")
    return _b64(payload, label, max_bytes), label


def _b64(text: str, label: str, max_bytes: int) -> bytes:
    _check_bytes(len(text) * 3 // 4, label, max_bytes)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageInputError(f"{label} is neither an existing file, a data URL, nor valid base64 ({e})") from e


def _check_bytes(size: int, label: str, max_bytes: int) -> None:
    if size > max_bytes:
        raise ImageInputError(f"{label} is {size:,} bytes, over the limit of {max_bytes:,} (max_bytes)")
