"""Group the routed (token, slot) pairs by expert for the grouped GEMMs of the fused MoE (step 2).

Pair p = t * k + s is token t's slot s, routed to expert topk_ids[t, s]. The pairs are listed
expert by expert, each expert's list padded with the sentinel T*k to a multiple of BLOCK_M, so a
BLOCK_M-row block of the list belongs to one expert (block_expert). Buffers and grids depend on T
only (static shapes, CUDA-graph capturable): the list has room for max_padded positions, the worst
case of T*k pairs plus BLOCK_M - 1 padding for each of min(E, T*k) experts; num_padded says how
many are used, and the GEMM programs of blocks past it return at once.

One program, in phases over chunks of the T*k ids (no host sync, one launch; from SPLIT_CHUNKS
chunks on, a prefill's, phases 1 and 3 run over a grid of one program per chunk instead, in a
launch before and one after the single program, which then only lays out the list):
1. counts per expert: tl.histogram of each chunk, summed (the ids loaded past T*k count as expert
   0 and are taken off again, so as not to depend on histogram's recent `mask` argument; its GPU
   lowering reads only the low log2(NUM_BINS) bits of a value, so every id must be < NUM_BINS);
2. padded counts, their exclusive prefix sum (each expert's first position), num_padded and
   block_expert (a block starting at position s is expert #{e: end_e <= s}), the sentinel in
   every expert's padding, and zeros in the fp32 row-amax buffer of the up projection;
3. each pair's position: its expert's cursor (in a scratch buffer, set to the first positions,
   then a barrier) advanced by tl.atomic_add. The order of the pairs within an expert follows the
   atomics and may change from run to run; the GEMMs compute each row independently of its
   position in a block, so their results do not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qruntime.kernels.pdl import launch_options, wait_for_inputs

CHUNK = 1024  # ids per histogram / scatter step
BLOCKS_PER_STEP = 64  # block_expert entries per step
PAD_STEP = 16  # padding positions per expert per step
SPLIT_CHUNKS = 8  # from this many chunks of ids (prefill), count and scatter run over a grid of programs


def padded_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Room for the grouped list: T*k pairs plus block_m - 1 padding for each expert that can be
    hit (min(E, T*k)), rounded up to block_m. A function of the step's token count only."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit
def _moe_align_kernel(
    ids_ptr,  # [T*k] int32 expert of each pair
    sorted_ptr,  # [max_padded] int32 pair ids grouped by expert; sentinel num_pairs in the padding
    block_expert_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    amax_ptr,  # [max_padded] fp32, zeroed here
    cursor_ptr,  # [NUM_BINS] int32 scratch
    num_pairs,
    num_experts,
    max_padded,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,  # power of two >= num_experts (and >= 32)
    CHUNK: tl.constexpr,
    BLOCKS_PER_STEP: tl.constexpr,
    PAD_STEP: tl.constexpr,
    SPLIT: tl.constexpr,  # phases 1 and 3 run in the grid kernels below; counts come in cursor_ptr
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    lanes = tl.arange(0, CHUNK)
    bins = tl.arange(0, NUM_BINS)

    # 1. tokens per expert
    if SPLIT:
        counts = tl.load(cursor_ptr + bins)
    else:
        counts = tl.zeros([NUM_BINS], dtype=tl.int32)
        for start in range(0, num_pairs, CHUNK):
            offs = start + lanes
            ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0)
            counts += tl.histogram(ids, NUM_BINS)
        masked = tl.cdiv(num_pairs, CHUNK) * CHUNK - num_pairs  # the zeros loaded past the end
        counts = tl.where(bins == 0, counts - masked, counts)
    counts = tl.where(bins < num_experts, counts, 0)

    # 2. layout of the grouped list
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    max_blocks = max_padded // BLOCK_M
    for b0 in range(0, max_blocks, BLOCKS_PER_STEP):
        blocks = b0 + tl.arange(0, BLOCKS_PER_STEP)
        before = (ends[None, :] <= blocks[:, None] * BLOCK_M) & (bins < num_experts)[None, :]
        tl.store(block_expert_ptr + blocks, tl.sum(before.to(tl.int32), axis=1), mask=blocks < max_blocks)
    first_pad = starts + counts
    num_pad = padded - counts  # 0 .. BLOCK_M - 1
    for j0 in tl.static_range(0, BLOCK_M, PAD_STEP):
        j = j0 + tl.arange(0, PAD_STEP)
        pad_pos = first_pad[:, None] + j[None, :]
        tl.store(sorted_ptr + pad_pos, num_pairs, mask=j[None, :] < num_pad[:, None])
    if not SPLIT:
        for start in range(0, max_padded, CHUNK):
            offs = start + lanes
            tl.store(amax_ptr + offs, tl.zeros([CHUNK], dtype=tl.float32), mask=offs < max_padded)

    # 3. scatter the pairs to their expert's positions
    tl.debug_barrier()  # every thread has read the counts before any overwrites them
    tl.store(cursor_ptr + bins, starts)
    if not SPLIT:
        tl.debug_barrier()  # the cursors are set before any thread advances one
        for start in range(0, num_pairs, CHUNK):
            offs = start + lanes
            mask = offs < num_pairs
            ids = tl.load(ids_ptr + offs, mask=mask, other=0)
            slot = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
            tl.store(sorted_ptr + slot, offs, mask=mask)


@triton.jit
def _moe_count_kernel(ids_ptr, counts_ptr, num_pairs, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Phase 1 over a grid: each program adds its chunk's histogram to counts (zeroed before)."""
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0)
    counts = tl.histogram(ids, NUM_BINS)
    past_end = tl.maximum(tl.program_id(0) * CHUNK + CHUNK - num_pairs, 0)  # zeros loaded past T*k
    bins = tl.arange(0, NUM_BINS)
    counts = tl.where(bins == 0, counts - past_end, counts)
    tl.atomic_add(counts_ptr + bins, counts, mask=counts > 0)


@triton.jit
def _moe_scatter_kernel(
    ids_ptr,
    sorted_ptr,
    cursor_ptr,
    amax_ptr,
    num_pairs,
    max_padded,
    AMAX_PER_PROGRAM,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    """Phase 3 over a grid: each program places its chunk's pairs (cursor atomics) and zeroes its
    share of the row-amax buffer."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    mask = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    slot = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
    tl.store(sorted_ptr + slot, offs, mask=mask)
    for start in range(pid * AMAX_PER_PROGRAM, (pid + 1) * AMAX_PER_PROGRAM, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        tl.store(amax_ptr + rows, tl.zeros([CHUNK], dtype=tl.float32), mask=rows < max_padded)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int32 -> (sorted_pair_ids [max_padded] int32, block_expert [max_blocks]
    int32, num_padded [1] int32, row_amax [max_padded] fp32 zeros), max_padded =
    padded_size(T*k, E, block_m). Entries past num_padded are unspecified. The ids must lie in
    [0, num_experts) (the routing kernel's do); they are not checked on the device. pdl: programmatic
    dependent launch (kernels/pdl.py)."""
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be int32 [T, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    topk_ids = topk_ids.contiguous()
    pairs = topk_ids.numel()
    max_padded = padded_size(pairs, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.zeros(1, dtype=torch.int32, device=dev)
    amax = torch.empty(max_padded, dtype=torch.float32, device=dev)
    if pairs == 0:
        return sorted_ids, block_expert, num_padded, amax
    bins = max(32, triton.next_power_of_2(num_experts))
    chunk = min(CHUNK, max(32, triton.next_power_of_2(pairs)))  # a decode step's few pairs: a small tile
    chunks = triton.cdiv(pairs, chunk)
    split = chunks >= SPLIT_CHUNKS
    cursor = (torch.zeros if split else torch.empty)(bins, dtype=torch.int32, device=dev)
    if split:
        _moe_count_kernel[(chunks,)](
            topk_ids, cursor, pairs, NUM_BINS=bins, CHUNK=chunk, num_warps=4, **launch_options(pdl)
        )
    _moe_align_kernel[(1,)](
        topk_ids,
        sorted_ids,
        block_expert,
        num_padded,
        amax,
        cursor,
        pairs,
        num_experts,
        max_padded,
        BLOCK_M=block_m,
        NUM_BINS=bins,
        CHUNK=chunk,
        BLOCKS_PER_STEP=BLOCKS_PER_STEP,
        PAD_STEP=min(PAD_STEP, block_m),
        SPLIT=split,
        num_warps=8 if chunk >= 512 else 4,
        **launch_options(pdl),
    )
    if split:
        per_program = triton.cdiv(triton.cdiv(max_padded, chunks), chunk) * chunk
        _moe_scatter_kernel[(chunks,)](
            topk_ids,
            sorted_ids,
            cursor,
            amax,
            pairs,
            max_padded,
            per_program,
            CHUNK=chunk,
            num_warps=4,
            **launch_options(pdl),
        )
    return sorted_ids, block_expert, num_padded, amax


def expert_load(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs routed to each expert: topk_ids [T, k] -> counts [E] int64 (no host sync)."""
    flat = topk_ids.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.int64, device=topk_ids.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
