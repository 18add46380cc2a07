"""Synthetic weights: random values of an artifact's exact shapes and dtypes, made on the device.

A synthetic artifact (`qcompile synth PRESET --artifact`) has the graph, manifest and tokenizer of
a real compile, but its weight files are sparse (all zero, no disk) and its manifest says
`"synthetic"`. Loading it fills every initializer with random values on the device instead of
reading the files, so the runtime can be measured at qwen3-235b-a22b scale without a 470 GB
download. The text it generates is noise; its speed is the real model's.

Values (FP8 codes stay well inside e4m3's range, activations stay bounded through the layers):
FP8 weights e4m3(N(0, 1) x 32) with scales 0.02/32 x U(0.5, 1.5) (dequantized weights ~ N(0, 0.02)),
packed int4 weights (int32 words of eight codes) uniform random bits with code -8 made 0, so the
codes are symmetric (-7..7, 0 twice as often: std sqrt(17.5), mean 0; a code mean of -0.5 would
add the same multiple of sum(x) to every output, the common part that collapses attention and
routing, see below) with scales 0.02/sqrt(17.5) x U(0.5, 1.5) (dequantized std ~0.02 as FP8's),
other matrices and biases (the vision tower's) N(0, 0.02), other 1-D tensors (norms) 1 + N(0, 0.02),
except the attention's q/k norms, QK_NORM_SCALE x (1 + N(0, 0.02)). Each tensor's values are a function of its name alone, so a tensor
replicated over tensor-parallel ranks is equal on every rank.

Why the q/k norms are larger: with weights near 1 the attention logits of random weights are ~N(0, 1)
whatever the head size, so attention is nearly uniform and every token's output is about the running
mean of V — the same for all tokens. That common part grows layer by layer until every token's router
input is nearly the same vector and routing collapses (on qwen3-30b-a3b / 235b-a22b shapes: in each
layer ~90 of 128 experts idle, the hottest ~16x the mean load, so a prefill measured the wrong MoE
work). At 6x the logits are ~N(0, 36): attention is sharp and token-specific, and routing over random
token ids spreads (measured on CPU, 128 experts / top 8: max/mean load 1.8-3.6 per layer over 8-16
layers, 3-6 at 48 layers, against 13-16 before; tests/runtime/test_synthetic_routing.py).
"""

from __future__ import annotations

import zlib
from collections.abc import Container
from pathlib import Path

import onnx
import torch

from qruntime.artifact import ArtifactFormatError
from qruntime.weights import load_initializers, runtime_dtype

FP8_SPREAD = 32.0  # std of the FP8 codes (e4m3 reaches 448)
INT4_SPREAD = 17.5**0.5  # std of the symmetric int4 codes (see the module doc)
INT4_PACKED, INT4_SCALE = "weight_packed", "weight_scale"  # compressed-tensors' names of an int4 weight
INT4_ZERO_POINT = "weight_zero_point"  # and of its zero points (uint8 codes in an artifact)
WEIGHT_STD = 0.02
QK_NORM_SCALE = 6.0  # the attention's q/k RMSNorm weights (see the module doc)
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
CHUNK_ELEMENTS = 1 << 28  # bound the bf16 temporaries of a large stacked tensor


def is_synthetic(manifest: dict) -> bool:
    return bool(manifest.get("synthetic"))


def _generator(name: str, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(zlib.crc32(name.encode()))
    return generator


def _fill_normal(out: torch.Tensor, mean: float, std: float, generator: torch.Generator) -> torch.Tensor:
    """out <- N(mean, std) cast to out's dtype (clamped to e4m3's range for FP8, whose cast does not
    saturate), CHUNK_ELEMENTS values at a time."""
    flat = out.view(-1)
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        part = flat[start : start + CHUNK_ELEMENTS]
        values = torch.randn(part.shape, generator=generator, device=out.device, dtype=torch.float32)
        values.mul_(std).add_(mean)
        if out.dtype == torch.float8_e4m3fn:
            values.clamp_(-448.0, 448.0)
        part.copy_(values)
    return out


def _fill_int4_words(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """out (int32) <- words of eight random 4-bit codes, code 0 (the value -8) made 8 (the value 0)."""
    flat = out.view(-1)
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        part = flat[start : start + CHUNK_ELEMENTS]
        words = torch.randint(
            -(1 << 31), 1 << 31, part.shape, generator=generator, device=out.device, dtype=torch.int32
        )
        for shift in range(0, 32, 4):
            low = ((words >> shift) & 0xF) == 0
            words |= low.to(torch.int32) << (shift + 3)  # shift 28: bit 31, the sign bit, wraps as intended
        part.copy_(words)
    return out


def random_tensor(
    name: str, shape: list[int], dtype: torch.dtype, device: torch.device, int4_scale: bool = False
) -> torch.Tensor:
    """The synthetic value of initializer `name` ([shape] of `dtype`, the compute dtype for floats);
    int4_scale: it is the scale of a packed int4 weight (an FP8 weight's otherwise)."""
    generator = _generator(name, device)
    out = torch.empty(shape, dtype=dtype, device=device)
    if dtype == torch.float8_e4m3fn:
        return _fill_normal(out, 0.0, FP8_SPREAD, generator)
    if dtype == torch.int32 and name.endswith(INT4_PACKED):
        return _fill_int4_words(out, generator)
    if dtype == torch.uint8 and name.endswith(INT4_ZERO_POINT):  # asymmetric int4: around the middle code
        return out.copy_(torch.randint(6, 11, shape, generator=generator, device=device, dtype=torch.uint8))
    if not dtype.is_floating_point:
        raise ArtifactFormatError(f"graph.onnx initializer {name!r}: a synthetic artifact has no {dtype} weights")
    if name.endswith(INT4_SCALE):
        scale = torch.rand(shape, generator=generator, device=device, dtype=torch.float32).add_(0.5)
        return out.copy_(scale.mul_(WEIGHT_STD / (INT4_SPREAD if int4_scale else FP8_SPREAD)))
    if name.endswith(".bias"):  # the vision tower's biases (Qwen3's text model has none)
        return _fill_normal(out, 0.0, WEIGHT_STD, generator)
    if len(shape) == 1:
        scale = QK_NORM_SCALE if name.endswith(QK_NORMS) else 1.0
        return _fill_normal(out, scale, WEIGHT_STD * scale, generator)
    return _fill_normal(out, 0.0, WEIGHT_STD, generator)


def random_initializers(
    root: Path,
    graph: onnx.GraphProto,
    device: torch.device,
    compute_dtype: torch.dtype,
    listed: Container[str] | None = None,
) -> dict[str, torch.Tensor]:
    """`weights.load_initializers` with random values, made on `device`, for the external (weight
    file) initializers, each checked against its (sparse) file under `root` first, so a shape the
    file could not hold is refused before anything is allocated; small inline constants are read
    as written."""

    packed = [
        i.name for i in graph.initializer if i.data_type == onnx.TensorProto.INT32 and i.name.endswith(INT4_PACKED)
    ]
    int4_scales = {name[: -len(INT4_PACKED)] + INT4_SCALE for name in packed}

    def make(init: onnx.TensorProto, dtype: torch.dtype) -> torch.Tensor:
        dtype = runtime_dtype(dtype, compute_dtype)
        return random_tensor(init.name, list(init.dims), dtype, device, int4_scale=init.name in int4_scales)

    return load_initializers(root, graph, device, compute_dtype, external=make, listed=listed)
