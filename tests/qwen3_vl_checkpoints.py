"""Tiny random Qwen3-VL checkpoints (dense and MoE) as transformers 5.17 saves them, with a
preprocessor_config.json for images a few patches across: what the end-to-end vision tests compile.

Importable from every test folder (tests/ is on sys.path through its conftest.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

IMAGE, VIDEO, START, END = 120, 121, 122, 123
TOKEN_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    in_channels=3,
    out_hidden_size=48,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 2],  # two features: added after text layers 0 and 1 of 3
)
TEXT = dict(
    vocab_size=128,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2], mrope_interleaved=True),
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20, mlp_only_layers=[1])
# factor 8 (patch 4 x merge 2), at most 48 x 48 pixels: a few tokens an image
PREPROCESSOR = {
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 64, "longest_edge": 48 * 48},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter from `gen`: norm weights near 1, embeddings unit noise, the rest small."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name and name.endswith(".weight"):
                param.copy_(1 + 0.2 * noise)
            elif "pos_embed" in name or "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(0.2 * noise)


def write_checkpoint(
    path: Path,
    kind: str,
    *,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    token_ids: dict[str, int] | None = None,
    tied: bool | None = None,
) -> torch.nn.Module:
    """A random `kind` ("dense": tied head; "moe": its own head, layer 1 dense) Qwen3-VL saved at
    `path` with PREPROCESSOR; returns the transformers model (eval, float32). The seed is printed.
    `text` / `vision` / `token_ids` override the tiny configs' keys, `tied` the kind's head."""
    seed = random.randrange(1 << 30)
    print(f"checkpoint seed {seed}")
    text, vision = dict(TEXT, **(text or {})), dict(VISION, **(vision or {}))
    ids = dict(TOKEN_IDS, **(token_ids or {}))
    tied = (kind == "dense") if tied is None else tied
    if kind == "dense":
        config = Qwen3VLConfig(vision_config=vision, text_config=text, tie_word_embeddings=tied, **ids)
        model = Qwen3VLForConditionalGeneration(config)
    else:
        text = dict(text, **MOE)
        config = Qwen3VLMoeConfig(vision_config=vision, text_config=text, tie_word_embeddings=tied, **ids)
        model = Qwen3VLMoeForConditionalGeneration(config)
    randomize(model, torch.Generator().manual_seed(seed))
    model.to(dtype).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return model.float().eval()
