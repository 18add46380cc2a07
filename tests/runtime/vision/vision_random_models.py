"""Fresh random weights for the tiny transformers Qwen3-VL models the vision tests compare against."""

from __future__ import annotations

import random

import torch
from qwen3_vl_checkpoints import randomize  # noqa: F401  (the vision tests' one copy)


def seeded() -> torch.Generator:
    """A generator from a fresh seed, printed (pytest shows it when a test fails)."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)
