"""Element addressing of a KV block pool, for kernels: every named layout as one formula.

The element (block b, kv head h, token offset t in the block, head-dim index i) of a pool lives at

    b * block + h * head + (t // tok_split) * tok_outer + (t % tok_split) * tok_inner
                         + (i // dim_split) * dim_outer + (i % dim_split) * dim_inner

(in elements). nhd / hnd are plain strides (splits that never divide); x-packed K splits the head
dim by x and V splits the token offset by X (docs/ARTIFACT.md). Kernels take the eight integers and
stay layout-agnostic: pool_addressing computes them on the host, pool_offsets is the formula inside
a kernel (the two splits constexpr, so `//` and `%` by them are shifts).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


@dataclass(frozen=True)
class PoolAddressing:
    block: int
    head: int
    tok_split: int
    tok_outer: int
    tok_inner: int
    dim_split: int
    dim_outer: int
    dim_inner: int

    def offset(self, b: int, h: int, t: int, i: int) -> int:
        """The formula above, for tests."""
        return (
            b * self.block
            + h * self.head
            + (t // self.tok_split) * self.tok_outer
            + (t % self.tok_split) * self.tok_inner
            + (i // self.dim_split) * self.dim_outer
            + (i % self.dim_split) * self.dim_inner
        )


def pool_addressing(
    dims: tuple[str, ...], shape: tuple[int, ...], strides: tuple[int, ...], block_size: int, head_dim: int
) -> PoolAddressing:
    """Addressing of a pool tensor with layout dims `dims` (KVLayout.k_dims or v_dims), its shape
    and element strides (tensor.stride())."""
    stride = dict(zip(dims, strides, strict=True))
    size = dict(zip(dims, shape, strict=True))
    tok_split, tok_outer, tok_inner = block_size, 0, stride.get("block_size", 0)
    if "X" in stride:  # x-packed V: offset t -> (t // X, t % X)
        tok_split, tok_outer, tok_inner = size["X"], stride["block_size/X"], stride["X"]
    dim_split, dim_outer, dim_inner = head_dim, 0, stride.get("head_dim", 0)
    if "x" in stride:  # x-packed K: head dim i -> (i // x, i % x)
        dim_split, dim_outer, dim_inner = size["x"], stride["head_dim/x"], stride["x"]
    return PoolAddressing(
        stride["blocks"], stride["kv_heads"], tok_split, tok_outer, tok_inner, dim_split, dim_outer, dim_inner
    )


@triton.jit
def pool_offsets(
    block,
    tok,
    head,
    dim,
    s_block,
    s_head,
    s_tok_outer,
    s_tok_inner,
    s_dim_outer,
    s_dim_inner,
    TOK_SPLIT: tl.constexpr,
    DIM_SPLIT: tl.constexpr,
):
    """The formula, elementwise over broadcastable block / tok (offset in the block) / head / dim."""
    base = block * s_block + head * s_head + (tok // TOK_SPLIT) * s_tok_outer + (tok % TOK_SPLIT) * s_tok_inner
    return base + (dim // DIM_SPLIT) * s_dim_outer + (dim % DIM_SPLIT) * s_dim_inner
