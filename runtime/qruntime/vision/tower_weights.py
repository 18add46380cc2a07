"""The vision tower's tensors, by the names Qwen3-VL checkpoints store them under.

transformers 5.17's save_pretrained writes a Qwen3VLForConditionalGeneration's (and a
Qwen3VLMoeForConditionalGeneration's) tower under `model.visual.`: patch_embed.proj (a Conv3d),
pos_embed, blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.linear_fc1,mlp.linear_fc2}, merger and
deepstack_merger_list.{j}, each with its bias. The match is a bijection: every expected tensor present
with its shape, nothing else under the prefix.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qruntime.shown import shown
from qruntime.vision.tower_config import VisionTowerConfig

DEFAULT_PREFIX = "model.visual."  # Qwen3VL(Moe)ForConditionalGeneration checkpoints


def tower_tensor_shapes(config: VisionTowerConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower (names without the prefix) → its shape, in checkpoint order."""
    c = config
    d, merged = c.hidden_size, c.merged_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (d, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size),
        "patch_embed.proj.bias": (d,),
        "pos_embed.weight": (c.num_position_embeddings, d),
    }
    for i in range(c.depth):
        shapes |= _affine(f"blocks.{i}.norm1", None, d)
        shapes |= _affine(f"blocks.{i}.attn.qkv", d, 3 * d)
        shapes |= _affine(f"blocks.{i}.attn.proj", d, d)
        shapes |= _affine(f"blocks.{i}.norm2", None, d)
        shapes |= _affine(f"blocks.{i}.mlp.linear_fc1", d, c.intermediate_size)
        shapes |= _affine(f"blocks.{i}.mlp.linear_fc2", c.intermediate_size, d)
    mergers = [("merger", d)] + [(f"deepstack_merger_list.{j}", merged) for j in range(len(c.deepstack_visual_indexes))]
    for name, norm_width in mergers:  # the deepstack mergers normalize after the m x m shuffle
        shapes |= _affine(f"{name}.norm", None, norm_width)
        shapes |= _affine(f"{name}.linear_fc1", merged, merged)
        shapes |= _affine(f"{name}.linear_fc2", merged, c.out_hidden_size)
    return shapes


def _affine(name: str, fan_in: int | None, fan_out: int) -> dict[str, tuple[int, ...]]:
    """A Linear's (fan_in given) or a LayerNorm's (fan_in None) weight and bias."""
    weight = (fan_out,) if fan_in is None else (fan_out, fan_in)
    return {f"{name}.weight": weight, f"{name}.bias": (fan_out,)}


def tower_weights(
    state_dict: Mapping[str, torch.Tensor], config: VisionTowerConfig, prefix: str = DEFAULT_PREFIX
) -> dict[str, torch.Tensor]:
    """The tower's tensors from `state_dict` (names without `prefix`), checked: each expected tensor
    present with its shape, one floating dtype and one device for all, and no other tensor under
    `prefix` (names outside it — the text model's — are not looked at). Errors name the tensor."""
    shapes = tower_tensor_shapes(config)
    for name in state_dict:
        if name.startswith(prefix) and name[len(prefix) :] not in shapes:
            raise ValueError(f"vision tower: unexpected tensor {shown(name)} (not part of this config's tower)")
    weights: dict[str, torch.Tensor] = {}
    first: tuple[str, torch.Tensor] | None = None
    for name, shape in shapes.items():
        full = prefix + name
        if full not in state_dict:
            raise ValueError(f"vision tower: tensor {full} is missing")
        tensor = state_dict[full]
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"vision tower: {full} is not a tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"vision tower: tensor {full} has shape {tuple(tensor.shape)}, expected {shape}")
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"vision tower: tensor {full} is {tensor.dtype}, expected a floating dtype")
        if first is None:
            first = (full, tensor)
        elif (tensor.dtype, tensor.device) != (first[1].dtype, first[1].device):
            raise ValueError(
                f"vision tower: tensor {full} is {tensor.dtype} on {tensor.device}, but {first[0]} is "
                f"{first[1].dtype} on {first[1].device}; the tower takes one dtype and device"
            )
        weights[name] = tensor
    return weights
