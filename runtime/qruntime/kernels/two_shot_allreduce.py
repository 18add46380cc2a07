"""Two-shot all-reduce over peer memory: a reduce-scatter, then an all-gather, for messages past the
one-shot kernel's best sizes (the `AllReduce` op; qruntime.comm.all_reduce chooses by size, from
`qcompile tune`'s measurements).

The message is cut into blocks of BLOCK elements, and the blocks into WORLD runs of `run` blocks:
rank r owns run r. Block b is always program b % grid's, on every rank and in every phase, so the
per-slot barriers of peer_sync.py order everything a program reads:
  1. every rank copies all of its x into its data half; barrier (the call's first count);
  2. rank r sums the blocks of its run from every rank's half, in fp32, rank 0 first, and writes the
     sum over its own copy of them (no other rank reads those blocks of it in this phase); barrier;
  3. every rank copies each block's sum from the half of the rank that owns it into its output.
Each rank reads about 2·n elements over the links against the one-shot's WORLD·n: the two-shot wins
on large messages at four or more ranks, and costs a second barrier. The bits are the one-shot's:
D(sum_r fp32(x_r)) in rank order, the same on every rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qruntime.kernels.dynamic_quant import check_model_dtype, round_to, use_hw_casts
from qruntime.kernels.pdl import launch_options, wait_for_inputs
from qruntime.kernels.peer_sync import Peers, barrier, call_counts, data_half, grid_of

BLOCK = 2048


@triton.jit
def _two_shot_kernel(
    x_ptr,  # [n] contiguous, model dtype
    out_ptr,  # [n] contiguous (may be x)
    n,
    run,  # blocks per rank's run: cdiv(cdiv(n, BLOCK), WORLD)
    data,  # this rank's data halves, typed as x: [2 * half]
    deltas,  # [WORLD] int64: rank r's data minus this rank's, in elements
    half,
    bases,
    counters,
    timeout_ns,
    abort,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    slot = tl.program_id(0)
    grid = tl.num_programs(0)
    blocks = tl.cdiv(n, BLOCK)
    first, second, parity = call_counts(counters, slot)
    mine = data + parity * half
    offs = tl.arange(0, BLOCK)
    for b in range(slot, blocks, grid):  # 1. all of x into this rank's half
        idx = tl.multiple_of(b * BLOCK, BLOCK) + offs
        mask = idx < n
        tl.store(mine + idx, tl.load(x_ptr + idx, mask=mask), mask=mask)
    alive = barrier(bases, counters, slot, first, timeout_ns, abort, RANK, WORLD, HW)
    lo = RANK * run  # 2. this rank's run: the blocks b of it with b % grid == slot
    hi = tl.minimum(lo + run, blocks) * alive  # nothing read from a dead rank
    for b in range(lo + (slot - lo % grid + grid) % grid, hi, grid):
        idx = tl.multiple_of(b * BLOCK, BLOCK) + offs
        mask = idx < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            peer = data_half(data, deltas, r, parity, half)
            acc += tl.load(peer + idx, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        tl.store(mine + idx, round_to(acc, DT, HW).to(DT), mask=mask)  # exact: a DT value
    alive = alive * barrier(bases, counters, slot, second, timeout_ns, abort, RANK, WORLD, HW)
    for b in range(slot, blocks * alive, grid):  # 3. every block's sum from the rank that owns it
        idx = tl.multiple_of(b * BLOCK, BLOCK) + offs
        mask = idx < n
        owner = data_half(data, deltas, b // run, parity, half)
        tl.store(out_ptr + idx, tl.load(owner + idx, mask=mask, cache_modifier=".cv"), mask=mask)


def two_shot_all_reduce(
    x: torch.Tensor, peers: Peers, out: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """The sum over the ranks of their x (contiguous, the peers' dtype, at most a data half) into
    `out` (a new tensor by default; x itself is allowed). Every rank calls it with the same shape."""
    check_model_dtype("x", x)
    peers.check_message(x)
    out = torch.empty_like(x) if out is None else out
    n = x.numel()
    if n:
        blocks = triton.cdiv(n, BLOCK)
        _two_shot_kernel[(grid_of(blocks),)](
            x, out, n, triton.cdiv(blocks, peers.world), peers.data, peers.deltas, peers.half, peers.bases,
            peers.counters, peers.timeout_ns, peers.abort.data_ptr(),
            RANK=peers.rank, WORLD=peers.world, BLOCK=BLOCK, HW=use_hw_casts(x), num_warps=8,
            **launch_options(pdl),
        )  # fmt: skip
    return out
