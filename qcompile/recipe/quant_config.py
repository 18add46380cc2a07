"""The compressed-tensors `quantization_config` of config.json, built without importing it.

It is what llm-compressor writes for the same scheme and ignore list (tests parse ours with
compressed-tensors and compare), so the exported checkpoint loads in transformers, vLLM and SGLang.
The compiler itself must run where llm-compressor is not installed, hence plain dicts here.
"""

from __future__ import annotations

from typing import Any

from qcompile.quant.schemes import PerBlock, PerChannel, PerGroupInt4, PerTensor, QuantScheme
from qcompile.recipe.schema import Recipe

COMPRESSED_TENSORS_VERSION = "0.19.0"  # the format version we write (compressed-tensors' own numbering)


def _args(
    strategy: str,
    dynamic: bool,
    block: list[int] | None = None,
    group: int | None = None,
    num_bits: int = 8,
    kind: str = "float",
    symmetric: bool = True,
) -> dict[str, Any]:
    return {
        "actorder": None,
        "block_structure": block,
        "dynamic": dynamic,
        "group_size": group,
        "num_bits": num_bits,
        "observer": None,
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": strategy,
        "symmetric": symmetric,
        "type": kind,
        "zp_dtype": None,
    }


def quantization_config(
    scheme: QuantScheme, recipe: Recipe, kv_cache_scheme: dict | None = None
) -> dict[str, Any] | None:
    """The `quantization_config` for `scheme` (and an FP8 KV cache's `kv_cache_scheme`), or None when
    neither weights nor KV cache are quantized."""
    if isinstance(scheme.weights, PerChannel):
        weights = _args("channel", dynamic=False)
        activations = _args("token", dynamic=True)
    elif isinstance(scheme.weights, PerTensor):
        # the source names' form (what split_to_sources gives): one [1] scale per tensor
        weights = _args("tensor", dynamic=False)
        activations = _args("tensor", dynamic=True)
    elif isinstance(scheme.weights, PerBlock):
        weights = _args("block", dynamic=False, block=[scheme.weights.block_n, scheme.weights.block_k])
        activations = _args("group", dynamic=True, group=scheme.activation_group)
    elif isinstance(scheme.weights, PerGroupInt4):  # W4A16: int weights packed, activations as they are
        weights = _args(
            "group",
            dynamic=False,
            group=scheme.weights.group_size,
            num_bits=4,
            kind="int",
            symmetric=not scheme.weights.zero_point,  # w4a16-zp: compressed-tensors' W4A16_ASYM
        )
        activations = None
    elif kv_cache_scheme is None:
        return None
    else:  # unquantized weights, quantized KV cache: no config groups, as llm-compressor writes it
        return _config({}, "dense", [], kv_cache_scheme)
    fmt = "pack-quantized" if isinstance(scheme.weights, PerGroupInt4) else "float-quantized"
    group = {
        "format": fmt,
        "input_activations": activations,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": weights,
    }
    return _config({"group_0": group}, fmt, list(recipe.quantization.ignore), kv_cache_scheme)


def fp8_kv_cache_scheme() -> dict[str, Any]:
    """The `kv_cache_scheme` of an FP8 (e4m3) KV cache with one static scale per layer for K and one
    for V, stored as `model.layers.{i}.self_attn.k_scale` / `v_scale` ([1], model dtype)."""
    return _args("tensor", dynamic=False)


def _config(groups: dict[str, Any], fmt: str, ignore: list[str], kv_cache_scheme: dict | None) -> dict[str, Any]:
    return {
        "config_groups": groups,
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": kv_cache_scheme,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }
