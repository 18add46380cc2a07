"""A whole Qwen3-VL model's forward in plain torch, float32: the reference the fast runtime is held to.

From a checkpoint directory (config.json + safetensors; Qwen3VLForConditionalGeneration or
Qwen3VLMoeForConditionalGeneration as transformers 5.17 saves them, or the published checkpoints),
token ids whose image placeholders are already expanded (vision_start, then t*h*w/merge² image
tokens, per image: what the processor produces), pixel_values and image_grid_thw:

1. the vision tower (tower.py) turns pixel_values into one embedding per image token and the deepstack
   features;
2. the token embeddings, with the image embeddings written over the image tokens' rows in order;
3. the M-RoPE positions of the prompt (positions.py) and their cos / sin;
4. the text decoder (reference_text.py), the deepstack features added to the image tokens' rows after
   its first len(deepstack) layers, the final norm;
5. lm_head (the token embeddings when tied) → logits [T, vocab].

No cache, one sequence, the whole prompt at once: simple rather than fast.

    model = load_reference(CKPT)
    logits = model(input_ids, inputs.pixel_values, inputs.image_grid_thw)  # [T, vocab] float32
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import torch
import torch.nn.functional as F

from qruntime import bounded_json
from qruntime.vision.positions import mrope_cos_sin, mrope_positions
from qruntime.vision.reference_config import ReferenceConfig
from qruntime.vision.reference_text import decode_layers
from qruntime.vision.reference_weights import LM_HEAD, read_checkpoint, text_weights
from qruntime.vision.tower import VisionTower, load_vision_tower
from qruntime.vision.tower_weights import DEFAULT_PREFIX as TOWER_PREFIX

_MAX_CONFIG_BYTES = 1 << 20


class Qwen3VLReference:
    """A Qwen3-VL model's weights in float32 and its config; call it for a prompt's logits."""

    def __init__(self, config: ReferenceConfig, state_dict: Mapping[str, torch.Tensor], device="cpu") -> None:
        """`state_dict`: the checkpoint's tensors by name, exactly this config's (errors name the tensor)."""
        self.config = config
        self.weights = MappingProxyType(text_weights(state_dict, config, device))
        tower_tensors = {
            k: v.to(device, torch.float32, copy=True) for k, v in state_dict.items() if k.startswith(TOWER_PREFIX)
        }
        self.tower: VisionTower = load_vision_tower(tower_tensors, config.tower)
        self.device = torch.device(device)

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Logits [T, vocab] float32 of every position of one prompt: input_ids [T] with each image's
        tokens expanded, pixel_values [patches, patch_dim] and image_grid_thw [images, 3] (both or
        neither). A prompt whose image tokens disagree with the grids is refused naming the image."""
        c = self.config
        ids = torch.as_tensor(input_ids)
        if ids.ndim != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be a non-empty 1-d sequence of token ids, got shape {list(ids.shape)}")
        ids = ids.to(torch.long)
        outside = ((ids < 0) | (ids >= c.text.vocab_size)).nonzero().flatten()
        if outside.numel():
            first = int(outside[0])
            raise ValueError(f"input_ids[{first}] = {int(ids[first])} is outside the vocabulary ({c.text.vocab_size})")
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw come together: give both or neither")
        grids = None if image_grid_thw is None else torch.as_tensor(image_grid_thw)
        positions = mrope_positions(ids, c.tokens, grids).positions  # [3, T], checks the runs against the grids
        cos, sin = mrope_cos_sin(positions.to(self.device), c.rope)  # [T, head_dim]

        ids = ids.to(self.device)
        x = F.embedding(ids, self.weights["embed_tokens.weight"])  # [T, hidden]
        visual_mask = ids == c.tokens.image_token_id  # [T]
        deepstack: list[torch.Tensor] = []
        if pixel_values is not None:
            embeddings, deepstack = self.tower(pixel_values.to(self.device, torch.float32), grids)
            x = x.index_put((visual_mask,), embeddings)  # the image tokens' rows, in order
        hidden = decode_layers(self.weights, c.text, x, cos, sin, visual_mask, deepstack)
        return F.linear(hidden, self.weights[LM_HEAD])  # [T, vocab]


def read_config(path: str | Path) -> ReferenceConfig:
    """config.json of a checkpoint directory, read as JSON only (bounded) and checked."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path}: no config.json")
    if config_path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ValueError(f"{config_path}: larger than {_MAX_CONFIG_BYTES} bytes")
    return ReferenceConfig.from_dict(bounded_json.loads(config_path.read_bytes(), what="config.json"))


def load_reference(path: str | Path, device: str | torch.device = "cpu") -> Qwen3VLReference:
    """The reference model of a Qwen3-VL checkpoint directory (config.json + safetensors), weights in
    float32 on `device`."""
    return Qwen3VLReference(read_config(path), read_checkpoint(path), device)
