"""The manifest's `vision` entry of a Qwen3-VL artifact (docs/vision.md, "Artifacts"): the vision graph's
file, its scheme (recipe vision.scheme), the tower's config, the image preprocessor's, the token ids that mark images, the DeepStack
layer count and the M-RoPE section: what the runtime needs besides the two graphs and the weights.

The preprocessor's settings come from the checkpoint's preprocessor_config.json (bounded JSON, as
every file of a checkpoint is read). A checkpoint without one (transformers' save_pretrained of a
bare model writes none) gets Qwen3-VL's published settings with the patch, temporal patch and merge
sizes of its own tower, so an image is cut into the patches that tower takes. Either way they are
checked here, and their patch sizes held to the tower's. The checkpoint's
video_preprocessor_config.json (frame sampling, the pixel bounds over a video's frames) is recorded
likewise, checked the same way, as `video_preprocessor`; without one the entry has none and the
runtime takes transformers' Qwen3VLVideoProcessor defaults with the image config's patch layout.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from qruntime.vision.preprocess import QWEN3_VL, VisionPreprocessConfig
from qruntime.vision.tower_config import VisionTowerConfig
from qruntime.vision.video import VideoPreprocessConfig

from qcompile.errors import CheckpointError
from qcompile.source.spec import ModelSpec, read_json

PREPROCESSOR_FILE = "preprocessor_config.json"
VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
VISION_GRAPH_FILE = "vision.onnx"
MAX_PREPROCESSOR_BYTES = 1 << 20


def preprocessor_config(checkpoint_dir: Path, tower: VisionTowerConfig) -> dict[str, Any]:
    """The image preprocessor's settings (preprocessor_config.json's keys), checked against `tower`."""
    path = checkpoint_dir / PREPROCESSOR_FILE
    if path.is_file():
        config = read_json(path, MAX_PREPROCESSOR_BYTES)
        where = str(path)
    else:
        config = {
            **{k: v for k, v in asdict(QWEN3_VL).items() if k not in ("min_pixels", "max_pixels")},
            "size": {"shortest_edge": QWEN3_VL.min_pixels, "longest_edge": QWEN3_VL.max_pixels},
            "patch_size": tower.patch_size,
            "temporal_patch_size": tower.temporal_patch_size,
            "merge_size": tower.spatial_merge_size,
        }
        where = f"{checkpoint_dir} (no {PREPROCESSOR_FILE}: Qwen3-VL's settings with the tower's patch sizes)"
    try:
        parsed = VisionPreprocessConfig.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    _check_patches(parsed, tower, where)
    return json.loads(json.dumps(config))  # plain JSON values (tuples become lists)


def video_preprocessor_config(checkpoint_dir: Path, tower: VisionTowerConfig) -> dict[str, Any] | None:
    """The video preprocessor's settings (video_preprocessor_config.json's keys), checked against
    `tower`; None for a checkpoint without the file."""
    path = checkpoint_dir / VIDEO_PREPROCESSOR_FILE
    if not path.is_file():
        return None
    config = read_json(path, MAX_PREPROCESSOR_BYTES)
    try:
        parsed = VideoPreprocessConfig.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    _check_patches(parsed, tower, str(path))
    return json.loads(json.dumps(config))


def _check_patches(
    parsed: VisionPreprocessConfig | VideoPreprocessConfig, tower: VisionTowerConfig, where: str
) -> None:
    for key, want in (
        ("patch_size", tower.patch_size),
        ("temporal_patch_size", tower.temporal_patch_size),
        ("merge_size", tower.spatial_merge_size),
    ):
        if getattr(parsed, key) != want:
            raise CheckpointError(
                f"{where}: {key} {getattr(parsed, key)} is not the vision tower's ({want}, config.json vision_config)"
            )


def vision_entry(spec: ModelSpec, checkpoint_dir: Path, scheme: str = "none") -> dict[str, Any]:
    """manifest["vision"] for a spec with `vision` set; `scheme` the recipe's vision.scheme (how the
    blocks' linears are stored: none, the model dtype; ptpc-fp8)."""
    vision = spec.vision
    if vision is None:
        raise ValueError(f"{spec.architecture} has no vision part")
    tower_dict = json.loads(vision.tower_config)
    tower = VisionTowerConfig.from_dict(tower_dict)
    video = video_preprocessor_config(checkpoint_dir, tower)
    return {
        "graph": VISION_GRAPH_FILE,
        "scheme": scheme,
        "tower_config": tower_dict,
        "preprocessor": preprocessor_config(checkpoint_dir, tower),
        **({"video_preprocessor": video} if video is not None else {}),
        "tokens": {
            "image_token_id": vision.image_token_id,
            "video_token_id": vision.video_token_id,
            "vision_start_token_id": vision.vision_start_token_id,
            "spatial_merge_size": vision.spatial_merge_size,
        },
        "deepstack_layers": vision.deepstack_layers,
        "mrope_section": list(vision.mrope_section),
    }
