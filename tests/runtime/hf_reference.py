"""Hugging Face transformers as the reference the runtime is compared with (tests only)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from qcompile.publish.unfuse import split_to_sources


def hf_model(ckpt: Path, dtype: torch.dtype) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()


def dequantized_checkpoint(ckpt: Path, artifact: Path, out: Path) -> Path:
    """A copy of `ckpt` whose weights are the artifact's, dequantized to fp32 (w_fp8 * scale): what
    transformers runs to isolate the error of activation quantization."""
    shutil.copytree(ckpt, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = {}
    for name, weight, scale in split_to_sources(artifact):
        tensors[name] = weight.float() * scale.float() if scale is not None else weight.float()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), V] of every prefix."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    """Greedy continuation by full forward passes (no cache, no generate() heuristics)."""
    seq = list(ids)
    for _ in range(steps):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `other` against `reference`, in dB."""
    noise = (reference - other).float().pow(2).mean()
    return float(10 * torch.log10(reference.float().pow(2).mean() / noise))
