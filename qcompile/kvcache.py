"""The KV-cache contract decided at compile time: dtype, named layout with its dims, block size, scales."""

from __future__ import annotations

from typing import Any

from qruntime.kv_layout import KV_LAYOUTS

from qcompile.recipe import Recipe
from qcompile.spec import ModelSpec


def kv_cache_spec(spec: ModelSpec, recipe: Recipe) -> dict[str, Any]:
    """The manifest's `kv_cache` entry. FP8 caches without calibration get unit scales, marked so."""
    kv = recipe.kv_cache
    layout = KV_LAYOUTS[kv.layout]  # fit to the model already checked by graph.build.check_plan
    scales = None
    if kv.dtype != "bf16":
        ones = [1.0] * spec.num_hidden_layers
        scales = {"calibrated": False, "k_scale": ones, "v_scale": list(ones)}
    return {
        "dtype": kv.dtype,
        "layout": layout.to_dict(),
        "block_size": kv.block_size,
        "num_layers": spec.num_hidden_layers,
        "num_kv_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "scales": scales,
    }
