"""The named KV-cache layouts of artifact format 1: one definition both compiler and runtime use."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

KV_DTYPES = MappingProxyType({"bf16": 2, "fp8_e4m3": 1})  # name -> bytes per element


@dataclass(frozen=True)
class KVLayout:
    """A cache layout: the dims of the K and V block pools, outermost first.

    Dim names: blocks, block_size, kv_heads, head_dim, and for `x-packed` head_dim/x, x,
    block_size/X, X, where x = X = 16 bytes / element size.
    """

    name: str
    k_dims: tuple[str, ...]
    v_dims: tuple[str, ...]

    def pack(self, kv_dtype: str) -> int:
        """Elements per 16-byte vector (the x of x-packed)."""
        return 16 // KV_DTYPES[kv_dtype]

    def check(self, block_size: int, head_dim: int | None, kv_dtype: str) -> None:
        """Raise ValueError naming the constraint this layout puts on block_size/head_dim
        (head_dim None: check block_size only)."""
        if self.name == "x-packed":
            x = self.pack(kv_dtype)
            if (head_dim is not None and head_dim % x) or block_size % x:
                raise ValueError(
                    f"layout x-packed with {kv_dtype} needs head_dim and block_size divisible by {x} "
                    f"(got head_dim={head_dim}, block_size={block_size})"
                )

    def shapes(
        self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, kv_dtype: str
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(K shape, V shape) of one layer's block pool."""
        size = {
            "blocks": num_blocks,
            "block_size": block_size,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "head_dim/x": head_dim // self.pack(kv_dtype),
            "x": self.pack(kv_dtype),
            "block_size/X": block_size // self.pack(kv_dtype),
            "X": self.pack(kv_dtype),
        }
        return tuple(size[d] for d in self.k_dims), tuple(size[d] for d in self.v_dims)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "k_dims": list(self.k_dims), "v_dims": list(self.v_dims)}


KV_LAYOUTS = MappingProxyType(
    {
        "nhd": KVLayout(
            "nhd",
            ("blocks", "block_size", "kv_heads", "head_dim"),
            ("blocks", "block_size", "kv_heads", "head_dim"),
        ),
        "hnd": KVLayout(
            "hnd",
            ("blocks", "kv_heads", "block_size", "head_dim"),
            ("blocks", "kv_heads", "block_size", "head_dim"),
        ),
        "x-packed": KVLayout(
            "x-packed",
            ("blocks", "kv_heads", "head_dim/x", "block_size", "x"),
            ("blocks", "kv_heads", "block_size/X", "head_dim", "X"),
        ),
    }
)
