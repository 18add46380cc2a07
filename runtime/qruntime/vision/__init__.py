"""Vision inputs for Qwen3-VL: images decoded and bounded (decode), resized as Pillow does
(resample), turned into the vision tower's patches (preprocess); the vision tower as a torch
reference (tower, tower_config, tower_grid, tower_weights); the text model's multimodal rotary
positions and their cos / sin (positions); a whole model's forward as a torch reference
(reference, reference_config, reference_text, reference_weights); chat messages with image parts
turned into the prompt's text, images and expanded token ids (prompt, prompt_images); videos given
as frames sampled, resized and patchified, with their timestamps (video)."""

from qruntime.vision.decode import ImageInputError, load_image
from qruntime.vision.positions import (
    MRopeConfig,
    MRopePositions,
    VisionTokenConfig,
    batch_mrope_positions,
    decode_positions,
    mrope_cos_sin,
    mrope_positions,
)
from qruntime.vision.preprocess import (
    QWEN3_VL,
    DecodedImages,
    VisionInputs,
    VisionPreprocessConfig,
    decode_images,
    preprocess_decoded,
    preprocess_images,
    smart_resize,
)
from qruntime.vision.prompt import (
    IMAGE_PLACEHOLDER,
    ImageLimits,
    ImageRef,
    PromptImageError,
    SplitMessages,
    split_images,
)
from qruntime.vision.prompt_images import (
    MultimodalPrompt,
    decode_prompt_images,
    encode_prompt,
    expand_image_tokens,
    image_token_counts,
    load_prompt_images,
    probe_images,
)
from qruntime.vision.reference import Qwen3VLReference, load_reference
from qruntime.vision.tower import VisionTower, load_vision_tower
from qruntime.vision.tower_config import VisionTowerConfig
from qruntime.vision.tower_weights import tower_tensor_shapes
from qruntime.vision.video import Video, VideoInputs, VideoPreprocessConfig, preprocess_videos

__all__ = [
    "IMAGE_PLACEHOLDER",
    "QWEN3_VL",
    "DecodedImages",
    "ImageInputError",
    "ImageLimits",
    "ImageRef",
    "MRopeConfig",
    "MRopePositions",
    "MultimodalPrompt",
    "PromptImageError",
    "Qwen3VLReference",
    "SplitMessages",
    "VisionInputs",
    "VisionPreprocessConfig",
    "VisionTokenConfig",
    "VisionTower",
    "VisionTowerConfig",
    "Video",
    "VideoInputs",
    "VideoPreprocessConfig",
    "batch_mrope_positions",
    "decode_images",
    "decode_positions",
    "decode_prompt_images",
    "encode_prompt",
    "expand_image_tokens",
    "image_token_counts",
    "load_image",
    "load_prompt_images",
    "load_reference",
    "load_vision_tower",
    "mrope_cos_sin",
    "mrope_positions",
    "preprocess_decoded",
    "preprocess_images",
    "preprocess_videos",
    "probe_images",
    "smart_resize",
    "split_images",
    "tower_tensor_shapes",
]
