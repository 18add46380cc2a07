"""The paged KV cache: one K and one V block pool per layer, in the artifact's named layout.

Indexing follows the layout's dims (kv_layout.py), so every layout shares one write and one gather:
a token at slot s lives in block s // block_size at offset s % block_size, and the dims that are not
block/offset address (kv_heads, head_dim) in order, possibly split into head_dim/x, x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qruntime.kv_layout import KV_DTYPES, KV_LAYOUTS, KVLayout
from qruntime.ops.functional import FP8, FP8_MAX
from qruntime.target import to_e4m3fnuz

_FP8_POOLS = (FP8, torch.float8_e4m3fnuz)

# dims that name a token's place in the pool; the rest are sliced whole
_ADDRESS_DIMS = frozenset({"blocks", "block_size", "block_size/X", "X"})


@dataclass(frozen=True)
class KVCacheSpec:
    """What the artifact decided about the cache (manifest `kv_cache`)."""

    layout: KVLayout
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_manifest(cls, entry: dict) -> KVCacheSpec:
        name = entry["layout"]["name"]
        if name not in KV_LAYOUTS:
            raise ValueError(f"kv_cache.layout {name!r} is not one of {sorted(KV_LAYOUTS)}")
        layout = KV_LAYOUTS[name]
        if list(entry["layout"]["k_dims"]) != list(layout.k_dims) or list(entry["layout"]["v_dims"]) != list(
            layout.v_dims
        ):
            raise ValueError(f"kv_cache.layout {name!r} dims differ from this runtime's definition of {name}")
        if entry["dtype"] not in KV_DTYPES:
            raise ValueError(f"kv_cache.dtype {entry['dtype']!r} is not one of {sorted(KV_DTYPES)}")
        spec = cls(
            layout, entry["dtype"], entry["block_size"], entry["num_layers"], entry["num_kv_heads"], entry["head_dim"]
        )
        layout.check(spec.block_size, spec.head_dim, spec.kv_dtype)
        return spec

    def storage_dtype(self, compute_dtype: torch.dtype, fp8: torch.dtype = FP8) -> torch.dtype:
        """fp8 caches store `fp8` (float8_e4m3fn; the amd-gfx942 target's float8_e4m3fnuz: KVCache);
        an unquantized cache stores the engine's compute dtype."""
        return fp8 if self.kv_dtype == "fp8_e4m3" else compute_dtype

    def block_bytes(self, compute_dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V."""
        elem = torch.empty(0, dtype=self.storage_dtype(compute_dtype)).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVCache:
    """Per-layer K/V pools of `num_blocks` blocks; write and gather by slot.

    An fp8 cache's pools are float8_e4m3fn, or with fp8=float8_e4m3fnuz (the amd-gfx942 target,
    qruntime.target) e4m3fnuz holding the same codes (e4m3fn's -0 as 0), which are read at twice the
    cache's k_scale / v_scale: every value is the e4m3fn cache's (the Triton kernels do the same)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        fp8: torch.dtype = FP8,
    ) -> None:
        if fp8 not in _FP8_POOLS:
            raise ValueError(f"an fp8 KV cache stores float8_e4m3fn or float8_e4m3fnuz, not {fp8}")
        self.spec = spec
        self.num_blocks = num_blocks
        dtype = spec.storage_dtype(compute_dtype, fp8)
        k_shape, v_shape = spec.layout.shapes(
            num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim, spec.kv_dtype
        )
        self.k = [torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self._pack = spec.layout.pack(spec.kv_dtype)

    def _index(self, dims: tuple[str, ...], slots: torch.Tensor) -> tuple:
        block, offset = slots // self.spec.block_size, slots % self.spec.block_size
        address = {
            "blocks": block,
            "block_size": offset,
            "block_size/X": offset // self._pack,
            "X": offset % self._pack,
        }
        return tuple(address.get(d, slice(None)) for d in dims)

    def _sliced_shape(self, dims: tuple[str, ...]) -> list[int]:
        sizes = {"kv_heads": self.spec.num_kv_heads, "head_dim": self.spec.head_dim, "x": self._pack}
        sizes["head_dim/x"] = self.spec.head_dim // self._pack
        return [sizes[d] for d in dims if d not in _ADDRESS_DIMS]

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_scale: float, v_scale: float
    ) -> None:
        """Store k, v [T, kv_heads, head_dim] at slot_mapping `slots` [T] (fp8: fp8(x / scale))."""
        for pool, x, dims, scale in (
            (self.k[layer], k, self.spec.layout.k_dims, k_scale),
            (self.v[layer], v, self.spec.layout.v_dims, v_scale),
        ):
            if pool.dtype in _FP8_POOLS:
                x = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
                if pool.dtype == torch.float8_e4m3fnuz:
                    x = to_e4m3fnuz(x, scale)[0]
            pool[self._index(dims, slots)] = x.reshape(len(slots), *self._sliced_shape(dims)).to(pool.dtype)

    def gather(
        self, layer: int, slots: torch.Tensor, k_scale: float, v_scale: float, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of `slots` [n] as `dtype` [n, kv_heads, head_dim] (fp8 dequantized with its scale in fp32)."""
        out = []
        for pool, dims, scale in (
            (self.k[layer], self.spec.layout.k_dims, k_scale),
            (self.v[layer], self.spec.layout.v_dims, v_scale),
        ):
            x = pool[self._index(dims, slots)].reshape(len(slots), self.spec.num_kv_heads, self.spec.head_dim)
            if pool.dtype == torch.float8_e4m3fnuz:
                scale = scale * 2  # e4m3fnuz(code) = e4m3fn(code) / 2: exact
            out.append((x.float() * scale).to(dtype) if pool.dtype in _FP8_POOLS else x.to(dtype))
        return out[0], out[1]
