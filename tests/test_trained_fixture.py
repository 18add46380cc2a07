"""The trained fixture tests/fixtures/qwen3-stdlib: a small real Qwen3 the tests can measure on.

It was made by examples/train_small_qwen3.py (the command and numbers are in its TRAINING.md and
training.json). These tests check it is what it claims: a genuine Qwen3 (GQA, QK-norm) that
transformers loads, whose held-out perplexity is what the record says and far from chance, that
writes Python, and that our compiler and runtime reproduce transformers' logits on it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import qruntime
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "qwen3-stdlib"
SCRIPT = ROOT / "examples" / "train_small_qwen3.py"
MAX_FIXTURE_BYTES = 15_000_000


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    return json.loads((FIXTURE / "training.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def model() -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))


@pytest.fixture(scope="module")
def windows(tokenizer: Tokenizer, record: dict[str, Any]) -> torch.Tensor:
    """heldout.txt as the training script scores it: non-overlapping windows [W, seq_len]."""
    seq_len = record["heldout"]["seq_len"]
    ids = tokenizer.encode((FIXTURE / "heldout.txt").read_text(encoding="utf-8"), add_special_tokens=False).ids
    count = len(ids) // seq_len
    return torch.tensor(ids[: count * seq_len]).view(count, seq_len)


@torch.inference_mode()
def _perplexity(model: Qwen3ForCausalLM, windows: torch.Tensor) -> float:
    """exp of the mean NLL of every token after the first of each window (8 windows a forward)."""
    total = 0.0
    for chunk in windows.split(8):
        logits = model(input_ids=chunk).logits[:, :-1]  # [8, S-1, V]
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"))
    return math.exp(total / windows[:, 1:].numel())


def test_fixture_is_a_small_genuine_qwen3(model: Qwen3ForCausalLM, record: dict[str, Any]) -> None:
    config = model.config
    assert config.model_type == "qwen3" and config.architectures == ["Qwen3ForCausalLM"]
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    for layer in model.model.layers:
        assert layer.self_attn.q_norm.weight.shape == layer.self_attn.k_norm.weight.shape == (config.head_dim,)
        assert not torch.allclose(layer.self_attn.q_norm.weight, torch.ones(config.head_dim))  # trained, not init
    assert sum(p.numel() for p in model.parameters()) == record["parameters"]
    with safe_open(str(FIXTURE / "model.safetensors"), "pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}  # noqa: SIM118
    assert sum(p.stat().st_size for p in FIXTURE.iterdir()) <= MAX_FIXTURE_BYTES


def test_heldout_perplexity_matches_the_record(
    model: Qwen3ForCausalLM, windows: torch.Tensor, record: dict[str, Any]
) -> None:
    heldout = record["heldout"]
    assert len(windows) == heldout["windows"]
    first = _perplexity(model, windows[: heldout["first_windows"]])
    assert first == pytest.approx(heldout["first_windows_perplexity"], rel=0.02)
    everything = _perplexity(model, windows)
    assert everything == pytest.approx(heldout["perplexity"], rel=0.02)
    assert everything < model.config.vocab_size / 100  # a uniform guess scores vocab_size


def test_greedy_continuation_of_a_def_is_python(model: Qwen3ForCausalLM, tokenizer: Tokenizer) -> None:
    # the prompt ends at "def", not "def ": BPE puts a name's space in front of it, so a trailing
    # space is a token the model has seen almost nowhere
    prompt = tokenizer.encode("import os\n\n\ndef", add_special_tokens=False).ids
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :].tolist()
    text = tokenizer.decode(out)
    assert len(set(out)) >= 12, text  # not a token or two repeated
    assert "(" in text and "):\n    " in text, text  # a signature, then an indented body


def test_training_script_help_runs() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--steps" in result.stdout and "--out" in result.stdout


def test_compiled_bf16_artifact_matches_transformers(compiled, model: Qwen3ForCausalLM, windows: torch.Tensor) -> None:
    engine = qruntime.load(compiled(FIXTURE, "bf16"), device="cpu", dtype=torch.float32, num_kv_blocks=16)
    ids = windows[0, :100].tolist()
    got = engine.score(ids)  # [T, V]
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([ids])).logits[0]
    assert float((got - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
