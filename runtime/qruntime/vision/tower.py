"""The Qwen3-VL vision tower in torch: the reference the runtime's vision encoder is held to.

pixel_values [patches, C*T*P*P] (preprocess.py's rows, merge-window order) and image_grid_thw
[images, 3] → the image embeddings [patches / m², out_hidden_size] that take the image tokens' places
in the text model, and one deepstack feature of the same shape per deepstack index, added to the
text model's first layers' hidden states at those places. As transformers 5.17's Qwen3VLVisionModel
computes them (the same for the dense and the MoE models):

1. patch embedding: a Conv3d whose kernel is the whole patch, so one matmul;
2. plus the learned position embedding, a square grid resampled bilinearly to each image's grid;
3. `depth` pre-norm ViT blocks (LayerNorm, attention with the 2-D rotary over (row, col), MLP), each
   frame of each image attending only within itself;
4. after the blocks listed in deepstack_visual_indexes, a deepstack merger: m x m neighbouring patches
   concatenated, LayerNorm, MLP (GELU) to out_hidden_size;
5. the merger: LayerNorm per patch, then the same concatenation and MLP.

The weights' dtype and device are the tower's; rotary and position-embedding weights are computed in
float32, as transformers does.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F

from qruntime.vision.tower_config import VisionTowerConfig
from qruntime.vision.tower_grid import grid_list, patch_coords, position_embeddings, rotary_cos_sin
from qruntime.vision.tower_weights import DEFAULT_PREFIX, tower_weights

_EPS = 1e-6  # every LayerNorm of the tower


class VisionTower:
    """The tower of `config` over `weights` (names as tower_weights returns them, without prefix).
    Call it with (pixel_values, image_grid_thw) → (embeddings, deepstack features)."""

    def __init__(self, config: VisionTowerConfig, weights: Mapping[str, torch.Tensor]) -> None:
        self.config = config
        self.weights = MappingProxyType(tower_weights(weights, config, prefix=""))
        first = self.weights["patch_embed.proj.weight"]
        self.dtype, self.device = first.dtype, first.device

    @torch.inference_mode()
    def __call__(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [patches, patch_dim] and image_grid_thw [images, 3] → (embeddings
        [patches / m², out_hidden_size], [one such tensor per deepstack index]), in the weights' dtype."""
        c, w = self.config, self.weights
        if pixel_values.dim() != 2 or pixel_values.shape[1] != c.patch_dim:
            raise ValueError(
                f"pixel_values must be [patches, {c.patch_dim}] (in_channels * temporal_patch_size * "
                f"patch_size**2), got shape {tuple(pixel_values.shape)}"
            )
        grids = grid_list(image_grid_thw, pixel_values.shape[0], c.spatial_merge_size)
        rows, cols, heights, widths = patch_coords(grids, c.spatial_merge_size, self.device)  # [N] each

        patch_weight = w["patch_embed.proj.weight"].reshape(c.hidden_size, c.patch_dim)
        x = F.linear(pixel_values.to(self.device, self.dtype), patch_weight, w["patch_embed.proj.bias"])  # [N, D]
        x = x + position_embeddings(w["pos_embed.weight"], rows, cols, heights, widths).to(self.dtype)
        cos, sin = rotary_cos_sin(rows, cols, c.head_dim, c.rope_theta)  # [N, head_dim] float32

        deepstack_merger = {layer: j for j, layer in enumerate(c.deepstack_visual_indexes)}
        deepstack = []
        for i in range(c.depth):
            x = self._block(f"blocks.{i}.", x, cos, sin, grids)
            if i in deepstack_merger:
                deepstack.append(self._merge(f"deepstack_merger_list.{deepstack_merger[i]}.", x, postshuffle=True))
        return self._merge("merger.", x, postshuffle=False), deepstack

    def _block(
        self, p: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        c, w = self.config, self.weights
        n, heads, head_dim = x.shape[0], c.num_heads, c.head_dim
        h = F.layer_norm(x, (c.hidden_size,), w[p + "norm1.weight"], w[p + "norm1.bias"], _EPS)
        qkv = F.linear(h, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"]).view(n, 3, heads, head_dim)
        q, k, v = qkv.unbind(1)  # [N, H, head_dim] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attn = torch.cat([_frames_attention(*parts, grid) for *parts, grid in _per_image(q, k, v, grids)])
        x = x + F.linear(attn.reshape(n, c.hidden_size), w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
        h = F.layer_norm(x, (c.hidden_size,), w[p + "norm2.weight"], w[p + "norm2.bias"], _EPS)
        h = _activate(F.linear(h, w[p + "mlp.linear_fc1.weight"], w[p + "mlp.linear_fc1.bias"]), c.hidden_act)
        return x + F.linear(h, w[p + "mlp.linear_fc2.weight"], w[p + "mlp.linear_fc2.bias"])

    def _merge(self, p: str, x: torch.Tensor, *, postshuffle: bool) -> torch.Tensor:
        """m x m neighbouring patches (consecutive rows, merge-window order) → one token of out_hidden_size;
        the LayerNorm is over each patch (merger) or over the concatenation (deepstack mergers)."""
        c, w = self.config, self.weights
        merged = c.merged_hidden_size
        if postshuffle:
            x = F.layer_norm(x.reshape(-1, merged), (merged,), w[p + "norm.weight"], w[p + "norm.bias"], _EPS)
        else:
            x = F.layer_norm(x, (c.hidden_size,), w[p + "norm.weight"], w[p + "norm.bias"], _EPS).reshape(-1, merged)
        x = F.gelu(F.linear(x, w[p + "linear_fc1.weight"], w[p + "linear_fc1.bias"]))
        return F.linear(x, w[p + "linear_fc2.weight"], w[p + "linear_fc2.bias"])  # [N / m², out_hidden_size]


def load_vision_tower(
    state_dict: Mapping[str, torch.Tensor], config: VisionTowerConfig, prefix: str = DEFAULT_PREFIX
) -> VisionTower:
    """The tower from a checkpoint's tensors (`state_dict` may hold the whole model: only names under
    `prefix` are read, and those must be exactly the tower's). Errors name the tensor."""
    return VisionTower(config, tower_weights(state_dict, config, prefix))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on [N, H, head_dim] with cos / sin [N, head_dim], in float32; back in x's dtype."""
    xf = x.to(torch.float32)
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def _per_image(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grids: list[tuple[int, int, int]]):
    """(q, k, v, grid) for each image's rows."""
    sizes = [t * h * w for t, h, w in grids]
    return zip(q.split(sizes), k.split(sizes), v.split(sizes), grids, strict=True)


def _frames_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """One image's attention, [t*h*w, H, head_dim] → same: each frame is a batch entry of its own."""
    t, h, w = grid
    heads, head_dim = q.shape[1:]

    def frames(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(t, h * w, heads, head_dim).transpose(1, 2)  # [t, H, h*w, head_dim]

    out = F.scaled_dot_product_attention(frames(q), frames(k), frames(v), scale=head_dim**-0.5)
    return out.transpose(1, 2).reshape(t * h * w, heads, head_dim)


def _activate(x: torch.Tensor, name: str) -> torch.Tensor:
    """The blocks' MLP activation, by transformers' name (tower_config.TOWER_ACTIVATIONS)."""
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    if name == "silu":
        return F.silu(x)
    raise ValueError(f"vision tower: hidden_act {name!r} is not supported")
