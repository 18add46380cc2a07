"""Fresh random weights for the tiny transformers Qwen3-VL models the vision tests compare against."""

from __future__ import annotations

import random

import torch


def seeded() -> torch.Generator:
    """A generator from a fresh seed, printed (pytest shows it when a test fails)."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter from `gen`: norm weights near 1 (nothing at its neutral init), position and
    token embeddings unit noise, the rest small (blocks stay well scaled)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name and name.endswith(".weight"):
                param.copy_(1 + 0.2 * noise)
            elif "pos_embed" in name or "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(0.2 * noise)
