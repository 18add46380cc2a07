"""Paged varlen prefill attention: causal GQA attention for a step mixing sequences of any q_len
(full prompts, prefill chunks after a cached prefix, decode rows), flash-attention style.

One program per (q head, BLOCK_M query tile, sequence); the query-tile axis is sized by the host
int max_q_len and tiles past a sequence's q_len exit at once. A program walks its sequence's K/V
tiles up to the causal limit of its query tile: the tiles every row of the tile sees run without
masks, the few on the diagonal with the causal mask. Online softmax in fp32 (log2 domain); P @ V
keeps ~16 bits of P (hi + lo halves) so results match the fp32 reference. Heavy (late) query tiles
are launched first so the causal imbalance does not leave a tail.

A mixed step's decode rows (q_len 1) are better served by the decode kernel, which packs a GQA
group's query heads into one tile and splits long contexts: here a 1-row query tile would fill one
of BLOCK_M rows and each q head would read its kv head's K/V again. Given num_prefills, the grid
covers only the sequences whose q_len is not 1 (program i finds the i-th of them by a scan of
query_start_loc on the device) and leaves the decode rows for paged_decode_attention.

A captured graph's step (a work list, bounds_work): the grid is sized from bounds alone (the bucket's
rows, the block tables' rows: bounds_tiles), never from the step's sequences, so one launch serves
every step of a token bucket. The host writes the step's work into a device buffer before the replay
(a few numpy ops, once per step for every layer): program t reads its (sequence, query tile), heaviest
first; the programs past the step's tiles zero the rows past its last sequence (the bucket's padding
rows: the ops after attention read them, and a row of stale memory could hold NaNs that a router
turns into an expert id). The decode kernel reads its rows from the same list.

K/V addressing is shared with the decode kernel (kv_addressing's eight integers per pool).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from qruntime.kernels.paged_decode_attention import (
    LOG2E,
    SCAN_BLOCK,
    WORK_HEADER,
    PagedKV,
    attend_tile,
    cdiv,
    check_block_tables,
    next_pow2,
    nth_sequence,
    paged_kv,
)
from qruntime.kernels.pdl import launch_options, wait_for_inputs
from qruntime.kv_layout import KVLayout


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters (a tuned kernel-config entry may override them). block_m shrinks to the
    step's longest q_len (at least 16) so short steps do not compute empty rows."""

    block_m: int = 64  # query rows per program (H100, one 8000-token qwen3-8b prompt: 64/64/4/3 took
    block_n: int = 64  # 1.97 ms, 128/128/8/3 2.05 ms, 128/64/8/3 2.17 ms, 128/64/4/3 2.47 ms)
    num_warps: int = 4
    num_stages: int = 3


BOUNDS_BLOCK_M = 64  # query rows per tile of a captured step (PrefillConfig's default)


def bounds_tiles(tokens: int, seqs: int) -> int:
    """The prefill grid's tiles (per head) of a captured step of `tokens` rows and `seqs` sequence
    rows: each prompt (q_len >= 2) adds at most one partial tile to its rows' count, so any step fits,
    and what its tiles leave over covers the rows past its last sequence (ceil((T - rows) / BLOCK_M))."""
    return cdiv(tokens, BOUNDS_BLOCK_M) + min(seqs, tokens // 2)


def work_size(tokens: int, seqs: int) -> int:
    return WORK_HEADER + seqs + 2 * bounds_tiles(tokens, seqs)


def bounds_work(query_start: Sequence[int], context_lens: Sequence[int], tokens: int, seqs: int) -> np.ndarray:
    """The work list of a step (its host query starts and context lengths) run from a captured graph
    of `tokens` rows and `seqs` sequence rows, int32 [work_size]: a header (the prompts' tile count,
    the decode count, the step's rows, 0), the decodes' sequence indices (the decode kernel's, seqs
    slots), then each tile's sequence and tile index (bounds_tiles slots each), heaviest tile first
    (the most cached positions to walk). Built in plain Python, a step's host time: for a verification
    step of one sequence 6 us against numpy's 32 (a dozen array ops' fixed costs), 21 against 40 at
    64 sequences, 64 against 55 at 256 (this repository's CI-class CPU)."""
    q_lens = [end - start for start, end in zip(query_start[:-1], query_start[1:], strict=True)]
    if len(q_lens) > seqs or query_start[-1] > tokens:
        raise ValueError(f"a step of {len(q_lens)} sequences and {query_start[-1]} rows exceeds {seqs} and {tokens}")
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    block = BOUNDS_BLOCK_M
    tiles = [  # (cached positions the tile walks, sequence, tile), for every tile of every prompt
        (context_lens[b] - n + min((t + 1) * block, n), b, t)
        for b, n in enumerate(q_lens)
        if n > 1
        for t in range(-(-n // block))
    ]
    tiles.sort(key=lambda tile: -tile[0])  # stable: ties keep the step's order
    grid = bounds_tiles(tokens, seqs)
    work = np.zeros(work_size(tokens, seqs), dtype=np.int32)
    work[:3] = (len(tiles), len(decodes), query_start[-1])
    work[WORK_HEADER : WORK_HEADER + len(decodes)] = decodes
    base = WORK_HEADER + seqs
    work[base : base + len(tiles)] = [b for _, b, _ in tiles]
    work[base + grid : base + grid + len(tiles)] = [t for _, _, t in tiles]
    return work


# no variants per step: the step's size and its block tables' width are ints Triton would specialize
# (equal to 1, or a multiple of 16), compiling mid-serving
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "bt_stride"])
def _prefill_kernel(
    q_ptr,  # [T, nh, d]
    k_ptr,
    v_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    query_start_ptr,  # [B+1] int32
    out_ptr,  # [T, nh * d]
    work_ptr,  # WORK only: bounds_work's list
    num_seqs,  # B (SKIP_DECODES and WORK only)
    num_tokens,  # T (WORK only: the rows to zero end there)
    q_stride_t,
    q_stride_h,
    bt_stride,
    qk_scale,  # scale * k_scale * log2(e)
    v_scale,
    k_blk,
    k_head,
    k_tok_outer,
    k_tok_inner,
    k_dim_outer,
    k_dim_inner,
    v_blk,
    v_head,
    v_tok_outer,
    v_tok_inner,
    v_dim_outer,
    v_dim_inner,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    K_TOK_SPLIT: tl.constexpr,
    K_DIM_SPLIT: tl.constexpr,
    V_TOK_SPLIT: tl.constexpr,
    V_DIM_SPLIT: tl.constexpr,
    SPLIT_P: tl.constexpr,
    UPCAST: tl.constexpr,
    SKIP_DECODES: tl.constexpr,
    WORK: tl.constexpr,  # a captured step: the grid's axis 1 is bounds_tiles, each tile read from work_ptr
    WORK_HEADER: tl.constexpr,
    SCAN: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    head = tl.program_id(0)
    nh = tl.num_programs(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if WORK:
        t = tl.program_id(1)
        tiles = tl.load(work_ptr)
        if t >= tiles:  # past the step's tiles: the (t - tiles)-th BLOCK_M rows past its last sequence
            pad = tl.load(work_ptr + 2) + (t - tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
            z_off = pad.to(tl.int64)[:, None] * (nh * HEAD_DIM) + head * HEAD_DIM + offs_d[None, :]
            zeros = tl.zeros([BLOCK_M, BLOCK_D], out_ptr.dtype.element_ty)
            tl.store(out_ptr + z_off, zeros, mask=(pad < num_tokens)[:, None] & d_mask[None, :])
            return
        seq = tl.load(work_ptr + WORK_HEADER + num_seqs + t)
        tile = tl.load(work_ptr + WORK_HEADER + num_seqs + tl.num_programs(1) + t)
    else:
        tile = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest tiles first
        n = tl.program_id(2)
        seq = nth_sequence(query_start_ptr, num_seqs, n, False, SCAN) if SKIP_DECODES else n  # the n-th prompt
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len  # cached positions before this step's queries
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_mask = rows < q_len
    q_off = (q_start + rows).to(tl.int64)[:, None] * q_stride_t + head * q_stride_h + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [M, D]
    q_pos = prefix + rows
    table = block_tables_ptr + seq * bt_stride
    k_head_off = kv_head * k_head
    v_head_off = kv_head * v_head

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # positions < prefix + tile * BLOCK_M are visible to every row of the tile: no masks there;
    # the tiles from there to the tile's causal end straddle the diagonal
    full_end = (prefix + tile * BLOCK_M) // BLOCK_N * BLOCK_N
    causal_end = prefix + tl.minimum(tile * BLOCK_M + BLOCK_M, q_len)
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, start + offs_n, causal_end, table, offs_d, d_mask, qk_scale,
            k_ptr, k_head_off, k_blk, k_tok_outer, k_tok_inner, k_dim_outer, k_dim_inner,
            v_ptr, v_head_off, v_blk, v_tok_outer, v_tok_inner, v_dim_outer, v_dim_inner,
            BLOCK_SIZE, K_TOK_SPLIT, K_DIM_SPLIT, V_TOK_SPLIT, V_DIM_SPLIT, SPLIT_P, UPCAST, False,
        )  # fmt: skip
    for start in range(full_end, causal_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, start + offs_n, causal_end, table, offs_d, d_mask, qk_scale,
            k_ptr, k_head_off, k_blk, k_tok_outer, k_tok_inner, k_dim_outer, k_dim_inner,
            v_ptr, v_head_off, v_blk, v_tok_outer, v_tok_inner, v_dim_outer, v_dim_inner,
            BLOCK_SIZE, K_TOK_SPLIT, K_DIM_SPLIT, V_TOK_SPLIT, V_DIM_SPLIT, SPLIT_P, UPCAST, True,
        )  # fmt: skip

    o = acc * (v_scale / l_i)[:, None]
    o_off = (q_start + rows).to(tl.int64)[:, None] * (nh * HEAD_DIM) + head * HEAD_DIM + offs_d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    layout: str | KVLayout,
    block_size: int,
    scale: float,
    k_scale: float,
    v_scale: float,
    num_kv_heads: int,
    max_q_len: int,
    config: PrefillConfig | None = None,
    num_prefills: int | None = None,
    work: torch.Tensor | None = None,
    kv: PagedKV | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Varlen causal paged attention: o [T, nh*d] for q [T, nh, d] of B sequences laid end to end.

    Sequence b's queries are rows query_start_loc[b] .. query_start_loc[b+1]-1 (int32 [B+1]); query
    i of its q_len sits at position context_lens[b] - q_len + i and sees cache positions <= it. Its
    K/V (this step's included) are in the pools through block_tables [B, max_blocks] int32, in
    `layout` (a name of KV_LAYOUTS or a KVLayout), model dtype or fp8 (stored as fp8(x / scale)).
    max_q_len is a host int >= every q_len (it sizes the grid; nothing reads the device tensors).
    config: tile sizes and launch parameters (PrefillConfig() when None).
    num_prefills: None computes every sequence. A host int, the step's count of sequences whose
    q_len is not 1: only those are computed and the rows of the q_len 1 sequences are left
    unwritten, for paged_decode_attention(..., query_start_loc=...) to fill.
    work: a captured graph's step (see the module docstring): bounds_work's list for this step, its
    T and B (the grid comes from them alone; max_q_len and num_prefills are not read); the prompts'
    rows are computed, the decode rows left unwritten as with num_prefills, and the rows past the
    step's last sequence zeroed. The caller pads its sequences with empty ones.
    kv: paged_kv(...) of these pools, q's dtype and heads and these scales, when the caller keeps it;
    None computes it. pdl: programmatic dependent launch (kernels/pdl.py).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, nh, d], got {tuple(q.shape)}")
    tokens, nh, d = q.shape
    if kv is None:
        kv = paged_kv(
            layout, q, k_pool, v_pool,
            block_size=block_size, num_kv_heads=num_kv_heads, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    check_block_tables(block_tables, q)
    batch = block_tables.shape[0]
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (batch,):
        raise ValueError(f"context_lens must be int32 [{batch}] (one per block_tables row)")
    if query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (batch + 1,):
        raise ValueError(f"query_start_loc must be int32 [{batch + 1}]")
    if max_q_len < 0:
        raise ValueError(f"max_q_len must be >= 0, got {max_q_len}")
    if num_prefills is not None and not 0 <= num_prefills <= batch:
        raise ValueError(f"num_prefills must be in [0, {batch}], got {num_prefills}")
    out = torch.empty(tokens, nh * d, dtype=q.dtype, device=q.device)
    cfg = config or PrefillConfig()
    if work is not None:
        if work.dtype != torch.int32 or work.numel() < work_size(tokens, batch):
            raise ValueError(f"work must be int32 of at least {work_size(tokens, batch)} (bounds_work's list)")
        block_m = BOUNDS_BLOCK_M
        grid = (nh, bounds_tiles(tokens, batch), 1)
    else:
        seqs = batch if num_prefills is None else num_prefills  # the grid's sequences
        if seqs == 0 or max_q_len == 0:
            return out
        block_m = min(cfg.block_m, max(16, next_pow2(max_q_len)))
        grid = (nh, cdiv(max_q_len, block_m), seqs)
    if tokens == 0:
        return out
    block_d = next_pow2(d)
    block_n = cfg.block_n
    num_warps = cfg.num_warps if block_m >= 64 else min(cfg.num_warps, 4)
    _prefill_kernel[grid](
        q, k_pool, v_pool, block_tables, context_lens, query_start_loc, out,
        query_start_loc if work is None else work, batch, tokens,
        q.stride(0), q.stride(1), block_tables.stride(0), scale * kv.k_scale * LOG2E, kv.v_scale,
        *kv.k_args(), *kv.v_args(),
        GROUP=nh // num_kv_heads, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, **kv.splits(), SPLIT_P=q.dtype != torch.float32,
        UPCAST=q.device.type != "cuda", SKIP_DECODES=num_prefills is not None, WORK=work is not None,
        WORK_HEADER=WORK_HEADER, SCAN=SCAN_BLOCK,
        num_warps=num_warps, num_stages=cfg.num_stages,
        **launch_options(pdl),
    )  # fmt: skip
    return out
