"""llm-compressor's side of the byte-for-byte comparisons, shared by the parity tests
(tests/compile) and the export tests (tests/commands): runs of `model_free_ptq` and `oneshot`,
cached per test module, and the comparisons of tensors and of `quantization_config`s.
(A helper module at tests/, importable from every test folder as the rootdir conftest puts tests/
on sys.path.)"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.utils.match import match_name
from llmcompressor import model_free_ptq, oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

BF16 = torch.bfloat16


FP8 = torch.float8_e4m3fn


IGNORE = ["lm_head", "re:.*mlp.gate$"]  # what our ptpc-fp8 / block-fp8 recipes ignore


EMBED = "model.embed_tokens"  # model_free_ptq has no module types to go by: it must be told


MODEL_FREE_IGNORE = [*IGNORE, EMBED]


LMHEAD_IGNORE = ["re:.*mlp.gate$", EMBED]  # ptpc-fp8-lmhead: lm_head quantized too


OBSERVER = ("observer", "observer_kwargs")  # calibration-time only: oneshot records "memoryless_minmax"


SIZE128 = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}


TENSOR_FP8 = "TENSOR_FP8"  # not a preset: the custom scheme of `llmc_scheme`, named for the run caches


def llmc_scheme(name: str) -> str | QuantizationScheme:
    """A preset name as it is, or TENSOR_FP8 as the scheme it stands for: FP8 weights with one static
    scale per tensor and activations with one dynamic scale per tensor (vLLM's load-time fp8)."""
    if name != TENSOR_FP8:
        return name
    args = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}
    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**args, dynamic=False),
        input_activations=QuantizationArgs(**args, dynamic=True),
    )


Tensors = dict[str, torch.Tensor]


def read_tensors(directory: Path) -> Tensors:
    """Every tensor of every safetensors file directly in `directory`."""
    tensors: Tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            assert name not in tensors, f"{name} appears in two files of {directory}"
            tensors[name] = tensor
    assert tensors, f"no tensors under {directory}"
    return tensors


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def assert_identical(ours: Tensors, reference: Tensors) -> None:
    """Same names, and every tensor with the same dtype, shape and bytes."""
    missing, extra = sorted(reference.keys() - ours.keys()), sorted(ours.keys() - reference.keys())
    assert not missing and not extra, f"names differ: missing from ours {missing}, only in ours {extra}"
    bad = [
        f"{k}: ours {ours[k].dtype} {tuple(ours[k].shape)} vs {reference[k].dtype} {tuple(reference[k].shape)}"
        for k in sorted(reference)
        if not same_bytes(ours[k], reference[k])
    ]
    assert not bad, f"{len(bad)} of {len(reference)} tensors differ:\n" + "\n".join(bad[:20])


def linear_modules(ckpt: Path) -> set[str]:
    """The checkpoint's linear layers (2-D weights but the embedding), plus lm_head (a Linear even when tied)."""
    modules = {"lm_head"}
    for file in ckpt.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if key.endswith(".weight") and len(handle.get_slice(key).get_shape()) == 2:
                    modules.add(key.removesuffix(".weight"))
    modules.discard(EMBED)
    return modules


def cached_runs(workdir: Path, prefix: str, run: Callable[..., None]) -> Callable[..., Path]:
    """`get(ckpt, *args) -> output dir`, running `run(ckpt, out, *args)` once per argument tuple."""
    outputs: dict[tuple, Path] = {}

    def get(ckpt: Path, *args: Any) -> Path:
        key = (str(ckpt), *(tuple(a) if isinstance(a, list) else a for a in args))
        if key not in outputs:
            out = workdir / f"{prefix}-{len(outputs)}-{ckpt.name}"
            run(ckpt, out, *args)
            outputs[key] = out
        return outputs[key]

    return get


def run_model_free(ckpt: Path, out: Path, scheme: str, ignore: Iterable[str]) -> None:
    model_free_ptq(str(ckpt), str(out), scheme=llmc_scheme(scheme), ignore=list(ignore), device="cpu")


def run_oneshot(ckpt: Path, out: Path, scheme: str, ignore: Iterable[str]) -> None:
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=BF16)
    if scheme == TENSOR_FP8:
        modifier = QuantizationModifier(config_groups={"group_0": llmc_scheme(scheme)}, ignore=list(ignore))
    else:
        modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore))
    oneshot(model=model, recipe=modifier)
    model.save_pretrained(out, save_compressed=True)


def quantization_config(directory: Path) -> tuple[QuantizationConfig, dict[str, Any]]:
    config = json.loads((directory / "config.json").read_text())
    return QuantizationConfig.model_validate(config.pop("quantization_config")), config


def args_dict(args: QuantizationArgs | None, drop: tuple[str, ...]) -> dict[str, Any] | None:
    return None if args is None else args.model_dump(exclude=set(drop))


def group_dicts(config: QuantizationConfig, drop: tuple[str, ...]) -> list[dict[str, Any]]:
    """The config groups without their names (ours: group_0; model_free: the preset's name)."""
    groups = [
        {
            "targets": sorted(s.targets),
            "format": s.format,
            "weights": args_dict(s.weights, drop),
            "input_activations": args_dict(s.input_activations, drop),
            "output_activations": args_dict(s.output_activations, drop),
        }
        for s in config.config_groups.values()
    ]
    return sorted(groups, key=repr)


def ignored_modules(config: QuantizationConfig, modules: set[str]) -> set[str]:
    """The ignore list resolved against the model's linear layers: oneshot lists module names,
    model_free and we list patterns, and model_free's list also names the embedding (no Linear)."""
    return {m for m in modules if any(match_name(m, pattern) for pattern in config.ignore or [])}


ATTN_ULPS = 3  # eager (llm-compressor) vs sdpa (ours) attention, from layer 1 on


def bf16_ulps(a: float, b: float) -> int:
    """How many bf16 steps apart two positive numbers are once rounded to bf16."""
    bits = torch.tensor([a, b], dtype=torch.bfloat16).view(torch.int16).int()
    return abs(int(bits[0] - bits[1]))
