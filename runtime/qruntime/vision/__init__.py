"""Vision inputs for Qwen3-VL: images decoded and bounded (decode), resized as Pillow does
(resample), turned into the vision tower's patches (preprocess)."""

from qruntime.vision.decode import ImageInputError, load_image
from qruntime.vision.preprocess import QWEN3_VL, VisionInputs, VisionPreprocessConfig, preprocess_images, smart_resize

__all__ = [
    "QWEN3_VL",
    "ImageInputError",
    "VisionInputs",
    "VisionPreprocessConfig",
    "load_image",
    "preprocess_images",
    "smart_resize",
]
