"""Shared fixtures: synthetic Qwen3 checkpoints (random weights, local tokenizer), built once per session.

The directories are shared between tests: treat them as read-only (copy one before changing it).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision_cpu

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe
from qcompile.synth import get_preset, write_checkpoint

# PyPI's torchvision (test-only: transformers' video processor) beside the CPU torch: see the module;
# here and in every process a test starts
_TORCHVISION_SHIM = torchvision_cpu.install()
_SITE = str(Path(__file__).parent / "torchvision_site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH")) if p)

MakeCkpt = Callable[..., Path]

# Triton kernels run in its interpreter on machines without a GPU (CI); set before triton is imported.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def fresh_torch_seed() -> None:
    """torch's generators (CPU and every GPU) from a fresh seed each test, printed (pytest shows it
    when the test fails): otherwise torch starts every process from the same default seed, and the
    tests that draw torch.randn inputs without the `rng` fixture would draw the same ones every run."""
    seed = random.randrange(1 << 31)
    print(f"torch seed {seed}")
    torch.manual_seed(seed)


@pytest.fixture
def rng() -> random.Random:
    """A fresh random.Random per test, its seed printed (pytest shows it when the test fails)."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    return random.Random(seed)


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory: pytest.TempPathFactory) -> MakeCkpt:
    """`make_ckpt(preset, *, seed=0, **config_overrides) -> Path` of a synthesized checkpoint.

    The overrides replace (or add) keys of the preset's config.json; the tokenizer follows the
    config's bos/eos ids and vocab_size. Equal arguments return the same directory.
    """
    root = tmp_path_factory.mktemp("synth")
    built: dict[str, Path] = {}

    def make(preset: str, *, seed: int = 0, **config_overrides: Any) -> Path:
        key = json.dumps([preset, seed, config_overrides], sort_keys=True)
        if key not in built:
            config = {**get_preset(preset).config(), **config_overrides}
            path = root / f"{preset}-{len(built)}"
            write_checkpoint(config, path, seed=seed)
            built[key] = path
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_ckpt(make_ckpt: MakeCkpt) -> Path:
    """Dense Qwen3, untied: 2 layers, hidden 64, 4 heads / 2 KV heads of 16, vocab 544."""
    return make_ckpt("tiny")


@pytest.fixture(scope="session")
def tiny_tied_ckpt(make_ckpt: MakeCkpt) -> Path:
    """`tiny` with tie_word_embeddings=true (no lm_head.weight in the shards)."""
    return make_ckpt("tiny-tied")


@pytest.fixture(scope="session")
def tiny_moe_ckpt(make_ckpt: MakeCkpt) -> Path:
    """Qwen3-MoE: 3 layers (layer 1 dense via mlp_only_layers), 8 experts of 32, top 2."""
    return make_ckpt("tiny-moe")


@pytest.fixture(scope="session")
def tiny_odd_ckpt(make_ckpt: MakeCkpt) -> Path:
    """Dense, non-power-of-two sizes: hidden 96, 6 heads / 3 KV heads, intermediate 72, vocab 538."""
    return make_ckpt("tiny-odd")


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`compiled(ckpt, recipe, *overrides) -> artifact dir`, compiled once per session (read-only)."""
    root = tmp_path_factory.mktemp("artifacts")
    built: dict[tuple, Path] = {}

    def get(ckpt: Path, recipe: str, *overrides: str) -> Path:
        key = (str(ckpt), recipe, overrides)
        if key not in built:
            out = root / f"{len(built)}-{ckpt.name}-{recipe}"
            compile_checkpoint(prepare(ckpt, load_recipe(recipe, list(overrides))), out, workers=2, progress=False)
            built[key] = out
        return built[key]

    return get
