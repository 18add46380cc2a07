"""The Qwen3-VL vision tower's shape: the `vision_config` of a Qwen3-VL checkpoint's config.json.

Qwen3VLForConditionalGeneration and Qwen3VLMoeForConditionalGeneration have the same vision tower in
transformers 5.17 (the MoE model's classes are copies of the dense ones), so one config serves both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from qruntime.shown import shown

# The activation of the blocks' MLP (the mergers always use exact GELU): transformers' names.
TOWER_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu")
# vision_config's model_type: the published checkpoints write "qwen3_vl" / "qwen3_vl_moe",
# transformers 5.17's save_pretrained the *_vision names.
_MODEL_TYPES = frozenset({"qwen3_vl", "qwen3_vl_vision", "qwen3_vl_moe", "qwen3_vl_moe_vision"})
# Keys that say nothing about the tower's computation (init scale, provenance).
_IGNORED = frozenset({"initializer_range", "transformers_version", "dtype", "torch_dtype", "_name_or_path"})
_ROPE_TYPES = frozenset({"axial", "default"})  # transformers turns "default" into "axial" for this tower
_DEFAULT_ROPE_THETA = 10000.0  # transformers' default for the tower's rotary


@dataclass(frozen=True)
class VisionTowerConfig:
    """The tower's sizes and settings. Build it with `from_dict(config["vision_config"])`."""

    depth: int  # ViT blocks
    hidden_size: int
    intermediate_size: int  # the blocks' MLP
    num_heads: int
    patch_size: int  # pixels per patch side
    temporal_patch_size: int  # frames per patch
    spatial_merge_size: int  # m: an m x m window of patches becomes one token
    in_channels: int
    out_hidden_size: int  # the text model's hidden size: what each merged token becomes
    num_position_embeddings: int  # a square grid of learned position embeddings
    deepstack_visual_indexes: tuple[int, ...]  # blocks whose output also goes through a deepstack merger
    hidden_act: str
    rope_theta: float = _DEFAULT_ROPE_THETA

    def __post_init__(self) -> None:
        for key in (
            "depth",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "patch_size",
            "temporal_patch_size",
            "spatial_merge_size",
            "in_channels",
            "out_hidden_size",
            "num_position_embeddings",
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"vision_config: {key} must be a positive integer, got {shown(value)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision_config: hidden_size ({self.hidden_size}) is not a multiple of num_heads ({self.num_heads})"
            )
        if self.head_dim % 4:
            raise ValueError(
                f"vision_config: hidden_size / num_heads ({self.head_dim}) must be a multiple of 4 "
                "(the 2-D rotary splits each head into h and w halves of cos/sin pairs)"
            )
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(
                f"vision_config: num_position_embeddings must be a square (a side x side grid), "
                f"got {self.num_position_embeddings}"
            )
        indexes = self.deepstack_visual_indexes
        if not isinstance(indexes, tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.depth for i in indexes
        ):
            raise ValueError(
                f"vision_config: deepstack_visual_indexes must be block indexes in [0, depth={self.depth}), "
                f"got {shown(indexes)}"
            )
        if list(indexes) != sorted(set(indexes)):
            # transformers emits the features in block order and one per distinct block; sorted and
            # distinct, the i-th feature is the i-th index's, as the text model reads them.
            raise ValueError(
                f"vision_config: deepstack_visual_indexes must be increasing, without repeats, got {shown(indexes)}"
            )
        if self.hidden_act not in TOWER_ACTIVATIONS:
            raise ValueError(
                f"vision_config: hidden_act {shown(self.hidden_act)} is not supported (one of {TOWER_ACTIVATIONS})"
            )
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
            raise ValueError(f"vision_config: rope_parameters.rope_theta must be a positive number, got {shown(theta)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch in pixel_values: in_channels * temporal_patch_size * patch_size**2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per merged token: spatial_merge_size**2."""
        return self.spatial_merge_size**2

    @property
    def merged_hidden_size(self) -> int:
        """A merged token's width before the merger's MLP: hidden_size * merge_unit."""
        return self.hidden_size * self.merge_unit

    @property
    def grid_side(self) -> int:
        """The learned position embeddings form a grid_side x grid_side grid."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_dict(cls, vision_config: Mapping[str, Any]) -> VisionTowerConfig:
        """From config.json's `vision_config` (Qwen3-VL dense or MoE). Every size is required; keys
        this tower does not know are refused, naming the key, rather than silently ignored."""
        if not isinstance(vision_config, Mapping):
            raise ValueError(f"vision_config must be a dict, got {shown(vision_config)}")
        required = [f.name for f in fields(cls) if f.name != "rope_theta"]
        known = {*required, "model_type", "rope_parameters", "rope_theta", *_IGNORED}
        for key in vision_config:
            if key not in known:
                raise ValueError(f"vision_config: unknown key {shown(key)} (this vision tower does not read it)")
        for key in required:
            if key not in vision_config:
                raise ValueError(f"vision_config: {key} is missing")
        model_type = vision_config.get("model_type", "qwen3_vl_vision")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"vision_config: model_type {shown(model_type)} is not a Qwen3-VL vision tower")
        indexes = vision_config["deepstack_visual_indexes"]
        if not isinstance(indexes, (list, tuple)):
            raise ValueError(f"vision_config: deepstack_visual_indexes must be a list, got {shown(indexes)}")
        values = {key: vision_config[key] for key in required}
        values["deepstack_visual_indexes"] = tuple(indexes)
        return cls(**values, rope_theta=_rope_theta(vision_config))


def _rope_theta(vision_config: Mapping[str, Any]) -> float:
    """rope_parameters {rope_type: axial (or default), rope_theta}, or the older top-level rope_theta."""
    legacy = vision_config.get("rope_theta")
    rope = vision_config.get("rope_parameters")
    if rope is None:
        return _DEFAULT_ROPE_THETA if legacy is None else legacy
    if not isinstance(rope, Mapping):
        raise ValueError(f"vision_config: rope_parameters must be a dict, got {shown(rope)}")
    for key in rope:
        if key not in ("rope_type", "rope_theta"):
            raise ValueError(f"vision_config: rope_parameters key {shown(key)} is not supported by this tower's rotary")
    if rope.get("rope_type", "axial") not in _ROPE_TYPES:
        raise ValueError(f"vision_config: rope_parameters.rope_type {shown(rope['rope_type'])} is not axial")
    theta = rope.get("rope_theta", _DEFAULT_ROPE_THETA if legacy is None else legacy)
    if legacy is not None and legacy != theta:
        raise ValueError(
            f"vision_config: rope_theta ({shown(legacy)}) and rope_parameters.rope_theta ({shown(theta)}) differ"
        )
    return theta
