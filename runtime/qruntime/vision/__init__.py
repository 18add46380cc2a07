"""Vision inputs for Qwen3-VL: images decoded and bounded (decode), resized as Pillow does
(resample), turned into the vision tower's patches (preprocess)."""

from qruntime.vision.decode import ImageInputError, load_image
from qruntime.vision.preprocess import QWEN3_VL, VisionInputs, VisionPreprocessConfig, preprocess_images, smart_resize
from qruntime.vision.tower import VisionTower, load_vision_tower
from qruntime.vision.tower_config import VisionTowerConfig
from qruntime.vision.tower_weights import tower_tensor_shapes

__all__ = [
    "QWEN3_VL",
    "ImageInputError",
    "VisionInputs",
    "VisionPreprocessConfig",
    "VisionTower",
    "VisionTowerConfig",
    "load_image",
    "load_vision_tower",
    "preprocess_images",
    "smart_resize",
    "tower_tensor_shapes",
]
