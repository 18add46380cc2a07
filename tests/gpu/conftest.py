"""The GPU tier (`pytest -m gpu`, on the lent device): kernels' production branches, CUDA graphs and
the engine's fast path on a real GPU. pyproject's addopts deselect these everywhere else (CI counts
none of them; each module here sets pytestmark = pytest.mark.gpu); asked for on a machine without CUDA, they fail at once, saying so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# head_dim 128 and a GQA group of 2, as the real models have, at a size that compiles in seconds
GPU_MODEL = {
    "hidden_size": 256,
    "head_dim": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
}


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("the gpu tier (pytest -m gpu) runs on a CUDA device; this machine has none")
    return torch.device("cuda")


@pytest.fixture(scope="session")
def gpu_artifact(make_ckpt, compiled, cuda) -> Path:
    """A small ptpc-fp8 artifact of the real dense layout (GPU_MODEL), compiled once per session."""
    return compiled(make_ckpt("tiny", **GPU_MODEL), "ptpc-fp8")


@pytest.fixture(scope="session")
def gpu_artifact_tp2(make_ckpt, compiled, cuda) -> Path:
    """gpu_artifact's checkpoint compiled for two GPUs (--tp 2)."""
    return compiled(make_ckpt("tiny", **GPU_MODEL), "ptpc-fp8", "tp=2")
