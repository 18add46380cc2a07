"""The two small kernels around the exchange of sharded sampling (engine/sharded_sampler.py): each
rank's candidates packed into its row of a [world, n, 2] fp32 buffer, and the ranks' best picked.

pack: row `rank` gets, for each of the n sampled rows, (value, id): value as given with NaN as +inf
(a faulty row's maximum then wins every comparison and stays non-finite), id = index + start, exact
in fp32 below 2^24; the other ranks' rows get zeros, so that a sum over the ranks (the custom
all-reduce) is every rank's row, exactly.
pick: for each row, the id of the first rank whose value is the largest (the lower id among equal
values, as an argmax over the whole vocabulary takes), and that value.

One launch each, where the same in torch ops took a dozen small launches a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


# one variant whatever the batch, the rank and its first column: ints Triton would otherwise
# specialize (equal to 1, a multiple of 16), compiling mid-serving
@triton.jit(do_not_specialize=["n", "rank", "start"])
def _pack_kernel(value_ptr, index_ptr, out_ptr, n, rank, start, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    v = tl.load(value_ptr + i, mask=mask, other=0.0).to(tl.float32)
    v = tl.where(v != v, float("inf"), v)
    idx = (tl.load(index_ptr + i, mask=mask, other=0) + start).to(tl.float32)
    for r in tl.static_range(WORLD):
        mine = rank == r
        tl.store(out_ptr + (r * n + i) * 2, tl.where(mine, v, 0.0), mask=mask)
        tl.store(out_ptr + (r * n + i) * 2 + 1, tl.where(mine, idx, 0.0), mask=mask)


@triton.jit(do_not_specialize=["n"])
def _pick_kernel(stacked_ptr, ids_ptr, best_ptr, n, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    best = tl.load(stacked_ptr + i * 2, mask=mask, other=0.0)
    ids = tl.load(stacked_ptr + i * 2 + 1, mask=mask, other=0.0)
    for r in tl.static_range(1, WORLD):
        v = tl.load(stacked_ptr + (r * n + i) * 2, mask=mask, other=0.0)
        take = v > best  # strictly: the first rank keeps a tie
        best = tl.where(take, v, best)
        ids = tl.where(take, tl.load(stacked_ptr + (r * n + i) * 2 + 1, mask=mask, other=0.0), ids)
    tl.store(ids_ptr + i, ids.to(tl.int64), mask=mask)
    tl.store(best_ptr + i, best, mask=mask)


def pack_candidates(value: torch.Tensor, index: torch.Tensor, rank: int, world: int, start: int) -> torch.Tensor:
    """[world, n, 2] fp32: row `rank` = (value, NaN as +inf; index + start), zeros elsewhere."""
    n = value.shape[0]
    out = torch.empty((world, n, 2), dtype=torch.float32, device=value.device)
    if n:
        _pack_kernel[(triton.cdiv(n, BLOCK),)](
            value.contiguous(), index.contiguous(), out, n, rank, start, WORLD=world, BLOCK=BLOCK
        )
    return out


def pick_best(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [n] int64, values [n] fp32) of the first rank with the largest value, per row of the
    ranks' candidates stacked [world, n, 2] fp32."""
    world, n, _ = stacked.shape
    ids = torch.empty(n, dtype=torch.int64, device=stacked.device)
    best = torch.empty(n, dtype=torch.float32, device=stacked.device)
    if n:
        _pick_kernel[(triton.cdiv(n, BLOCK),)](stacked.contiguous(), ids, best, n, WORLD=world, BLOCK=BLOCK)
    return ids, best
