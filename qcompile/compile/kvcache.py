"""The KV-cache contract decided at compile time: dtype, named layout with its dims, block size, scales."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qruntime.kv_layout import KV_LAYOUTS

from qcompile.compile.sharding import local_heads
from qcompile.recipe.schema import Recipe
from qcompile.source.spec import ModelSpec


@dataclass(frozen=True)
class KVScales:
    """Per-layer k/v scales and what they were calibrated on."""

    k_scale: tuple[float, ...]
    v_scale: tuple[float, ...]
    tokens: int
    data: str  # file name
    data_sha256: str

    def to_manifest(self) -> dict:
        """The manifest's kv_cache.scales entry (docs/ARTIFACT.md)."""
        return {
            "calibrated": True,
            "k_scale": list(self.k_scale),
            "v_scale": list(self.v_scale),
            "calibration": {"data": self.data, "sha256": self.data_sha256, "tokens": self.tokens},
        }


def kv_cache_spec(spec: ModelSpec, recipe: Recipe, kv_scales: KVScales | None = None) -> dict[str, Any]:
    """The manifest's `kv_cache` entry: the cache of one rank (num_kv_heads its share of the KV heads at
    tp > 1). FP8 caches without calibration get unit scales, marked so."""
    kv = recipe.kv_cache
    layout = KV_LAYOUTS[kv.layout]  # fit to the model already checked by graph.build.check_plan
    scales = None
    if kv_scales is not None:
        scales = kv_scales.to_manifest()
    elif kv.dtype != "bf16":
        ones = [1.0] * spec.num_hidden_layers
        scales = {"calibrated": False, "k_scale": ones, "v_scale": list(ones)}
    return {
        "dtype": kv.dtype,
        "layout": layout.to_dict(),
        "block_size": kv.block_size,
        "num_layers": spec.num_hidden_layers,
        "num_kv_heads": local_heads(spec, recipe.tp)[1],
        "head_dim": spec.head_dim,
        "scales": scales,
    }
