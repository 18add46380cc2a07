"""The compressed-tensors `quantization_config` of config.json, built without importing it.

It is what llm-compressor writes for the same scheme and ignore list (tests parse ours with
compressed-tensors and compare), so the exported checkpoint loads in transformers, vLLM and SGLang.
The compiler itself must run where llm-compressor is not installed, hence plain dicts here.
"""

from __future__ import annotations

from typing import Any

from qcompile.quant.schemes import PerBlock, PerChannel, PerTensor, QuantScheme
from qcompile.recipe import Recipe

COMPRESSED_TENSORS_VERSION = "0.19.0"  # the format version we write (compressed-tensors' own numbering)


def _args(strategy: str, dynamic: bool, block: list[int] | None = None, group: int | None = None) -> dict[str, Any]:
    return {
        "actorder": None,
        "block_structure": block,
        "dynamic": dynamic,
        "group_size": group,
        "num_bits": 8,
        "observer": None,
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": strategy,
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    }


def quantization_config(
    scheme: QuantScheme, recipe: Recipe, kv_cache_scheme: dict | None = None
) -> dict[str, Any] | None:
    """The `quantization_config` for `scheme`, or None for an unquantized artifact."""
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
    else:
        return None
    return {
        "config_groups": {
            "group_0": {
                "format": "float-quantized",
                "input_activations": activations,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": list(recipe.quantization.ignore),
        "kv_cache_scheme": kv_cache_scheme,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }
