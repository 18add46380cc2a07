"""Paged decode attention (flash-decoding): one query per sequence over its whole cached context.

Stage 1 runs one program per (sequence, kv head, partition of the context): it loads each K/V tile
of the partition once for all the q heads of that kv head (GQA group, padded to 16 rows for
tl.dot), keeps the online-softmax running max / sum in fp32 and writes the partition's normalized
output and log-sum-exp. Stage 2 merges the partitions of each (sequence, head) with the
log-sum-exp trick. With one partition, stage 1 writes the output directly and stage 2 is skipped.

The number of partitions comes from host ints the caller fixes (num_splits, or max_context_len, or
the block table's width), never from context_lens' data: no host sync, CUDA-graph capturable. The
partitions' length is computed on the device from each sequence's own context (at least
min_partition tokens), so a short context in a graph captured for the longest one still spreads
over several programs instead of queueing its tiles in the first.

Mixed steps (decodes beside prefill chunks): given the step's query_start_loc, the kernels run
only for its sequences of q_len 1 (program i finds the i-th of them by a scan of query_start_loc,
nth_sequence) and write their rows of the step's output; the prefill kernel does the others.

Pools in any named layout (nhd, hnd, x-packed; model dtype or fp8) are addressed by the eight
integers of qruntime.kernels.kv_addressing; fp8 values are multiplied by k_scale / v_scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qruntime.kernels.kv_addressing import PoolAddressing, pool_addressing, pool_offsets
from qruntime.kernels.pdl import launch_options, wait_for_inputs
from qruntime.kv_layout import KV_LAYOUTS, KVLayout

FP8 = torch.float8_e4m3fn
# fp8 pools: e4m3fn, or amd-gfx942's e4m3fnuz holding the same codes (-0 as 0), read at twice the scales
FP8_POOLS = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
LOG2E = 1.4426950408889634
# Timed on an H100 at qwen3-8b shapes (CUDA-graph replay, block_n 32): B=1 ctx 512 takes 12 µs with
# 8 partitions of 64 and 17 µs with 2 of 256; B=1 ctx 8000 ~28 µs with 32 to 125 partitions. With
# B=64 (512 programs at one partition) ctx 8000: 717 µs at 1 partition, 875 at 2, 723 at 3: program
# counts just past what is resident at once leave a second, mostly idle wave. 3 per SM avoids that.
MIN_PARTITION = 64  # tokens
TARGET_PROGRAMS_PER_SM = 3
SCAN_BLOCK = 128  # sequences nth_sequence reads at a time
# partitions the reduce reads at a time, whatever the split count: one compiled variant for every step
# (sized to the count, it was a new Triton compile mid-serving for each power of two a mixed step met)
REDUCE_BLOCK_S = 32
WORK_HEADER = 4  # a captured step's work list (paged_prefill_attention.bounds_work): its header's ints


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the partition kernel (a tuned kernel-config entry may override them).
    The defaults were the best or within 5% of it at every qwen3-8b decode shape timed on an H100."""

    block_n: int = 32  # tokens per K/V tile
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class PagedKV:
    """What the paged attention kernels need to read K and V: addressing and dequant scales."""

    k: PoolAddressing
    v: PoolAddressing
    k_scale: float  # 1.0 unless the pool is fp8 (an e4m3fnuz pool's: twice the cache's scale)
    v_scale: float

    def k_args(self) -> tuple[int, ...]:
        """Runtime ints of K (block, head, tok_outer, tok_inner, dim_outer, dim_inner)."""
        a = self.k
        return (a.block, a.head, a.tok_outer, a.tok_inner, a.dim_outer, a.dim_inner)

    def v_args(self) -> tuple[int, ...]:
        a = self.v
        return (a.block, a.head, a.tok_outer, a.tok_inner, a.dim_outer, a.dim_inner)

    def splits(self) -> dict[str, int]:
        """The splits are compile-time constants (few values per layout): divisions become shifts and
        the compiler sees the contiguous runs of head_dim, so loads stay 16 bytes wide."""
        return {
            "K_TOK_SPLIT": self.k.tok_split,
            "K_DIM_SPLIT": self.k.dim_split,
            "V_TOK_SPLIT": self.v.tok_split,
            "V_DIM_SPLIT": self.v.dim_split,
        }


def paged_kv(
    layout: str | KVLayout,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    *,
    block_size: int,
    num_kv_heads: int,
    k_scale: float,
    v_scale: float,
) -> PagedKV:
    """Check q [.., nh, d] and the pools against each other; the pools' addressing. The same for every
    step of a layer: an op may keep it (its checks cost more host time than the rest of a kernel call)."""
    kv_layout = KV_LAYOUTS[layout] if isinstance(layout, str) else layout
    nh, d = q.shape[-2], q.shape[-1]
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} is not bf16, fp16 or fp32")
    if nh % num_kv_heads:
        raise ValueError(f"q has {nh} heads, not a multiple of num_kv_heads={num_kv_heads}")
    if q.stride(-1) != 1:
        raise ValueError("q's head_dim must be contiguous")
    fp8 = k_pool.dtype in FP8_POOLS
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dtype not in (q.dtype, *FP8_POOLS) or pool.dtype != k_pool.dtype:
            raise ValueError(
                f"{name} dtype {pool.dtype}: expected q's {q.dtype}, {FP8} or float8_e4m3fnuz for both pools"
            )
        if pool.device != q.device:
            raise ValueError(f"{name} is on {pool.device}, q on {q.device}")
    fnuz = k_pool.dtype == torch.float8_e4m3fnuz
    kv_layout.check(block_size, d, "fp8_e4m3" if fp8 else "bf16")
    expected = kv_layout.shapes(k_pool.shape[0], block_size, num_kv_heads, d, "fp8_e4m3" if fp8 else "bf16")
    for name, pool, shape in (("k_pool", k_pool, expected[0]), ("v_pool", v_pool, expected[1])):
        if tuple(pool.shape) != shape:
            raise ValueError(f"{name} shape {tuple(pool.shape)} != {shape} for layout {kv_layout.name}")
    return PagedKV(
        pool_addressing(kv_layout.k_dims, tuple(k_pool.shape), k_pool.stride(), block_size, d),
        pool_addressing(kv_layout.v_dims, tuple(v_pool.shape), v_pool.stride(), block_size, d),
        (k_scale * 2 if fnuz else k_scale) if fp8 else 1.0,  # e4m3fnuz(code) = e4m3fn(code) / 2: exact
        (v_scale * 2 if fnuz else v_scale) if fp8 else 1.0,
    )


def check_block_tables(block_tables: torch.Tensor, q: torch.Tensor) -> None:
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.device != q.device:
        raise ValueError("block_tables must be int32 [B, max_blocks] on q's device")


@triton.jit
def kv_tile_offsets(
    blk,  # [N] int64 physical block of each token
    t,  # [N] token offset in its block
    dims,  # [D] head-dim indices
    head_off,
    blk_stride,
    tok_outer,
    tok_inner,
    dim_outer,
    dim_inner,
    TOK_SPLIT: tl.constexpr,
    DIM_SPLIT: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """Element offsets of a K/V tile by the kv_addressing formula: [D, N] if TRANSPOSED else [N, D]
    (head_off: the kv head's offset, already multiplied by its stride)."""
    if TRANSPOSED:
        blk, t, dims = blk[None, :], t[None, :], dims[:, None]
    else:
        blk, t, dims = blk[:, None], t[:, None], dims[None, :]
    return pool_offsets(
        blk, t, 1, dims, blk_stride, head_off, tok_outer, tok_inner, dim_outer, dim_inner, TOK_SPLIT, DIM_SPLIT
    )


@triton.jit
def dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b accumulated in fp32 (fp32 operands in full precision, never tf32). UPCAST feeds
    fp32 operands: the same products for half inputs (exact in fp32), for the CPU interpreter, whose
    bf16 dot multiplies the raw bits."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def weighted_values(acc, p, v, SPLIT_P: tl.constexpr, UPCAST: tl.constexpr):
    """acc + p @ v with p [M, N] fp32 and v [N, D] in the dot dtype. SPLIT_P (half-precision v): p
    is split into hi + lo halves (two tensor-core dots), so the sum keeps ~16 bits of p like the fp32
    reference; rounding p to bf16 alone (flash-attention's way) is off by several bf16 ulps at times."""
    if SPLIT_P:
        p_hi = p.to(v.dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
        acc = dot(p_lo, v, dot(p_hi, v, acc, UPCAST), UPCAST)
    else:
        acc = dot(p.to(v.dtype), v, acc, UPCAST)
    return acc


@triton.jit
def attend_tile(
    acc,  # [M, D] fp32
    m_i,  # [M] running max (log2 domain)
    l_i,  # [M] running sum
    q,  # [M, D]
    q_pos,  # [M] positions of the rows
    pos,  # [N] positions of this K/V tile
    causal_end,
    table,  # this sequence's block-table row
    offs_d,
    d_mask,
    qk_scale,
    k_ptr,
    k_head_off,
    k_blk,
    k_tok_outer,
    k_tok_inner,
    k_dim_outer,
    k_dim_inner,
    v_ptr,
    v_head_off,
    v_blk,
    v_tok_outer,
    v_tok_inner,
    v_dim_outer,
    v_dim_inner,
    BLOCK_SIZE: tl.constexpr,
    K_TOK_SPLIT: tl.constexpr,
    K_DIM_SPLIT: tl.constexpr,
    V_TOK_SPLIT: tl.constexpr,
    V_DIM_SPLIT: tl.constexpr,
    SPLIT_P: tl.constexpr,
    UPCAST: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One K/V tile of the online softmax for query rows at q_pos: positions past causal_end or past a
    row's own position are masked when MASKED (prefill's diagonal tiles, decode's partition ends)."""
    if MASKED:
        n_mask = pos < causal_end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
    t = pos % BLOCK_SIZE
    k_off = kv_tile_offsets(
        blk, t, offs_d, k_head_off, k_blk, k_tok_outer, k_tok_inner, k_dim_outer, k_dim_inner,
        K_TOK_SPLIT, K_DIM_SPLIT, True,
    )  # fmt: skip
    v_off = kv_tile_offsets(
        blk, t, offs_d, v_head_off, v_blk, v_tok_outer, v_tok_inner, v_dim_outer, v_dim_inner,
        V_TOK_SPLIT, V_DIM_SPLIT, False,
    )  # fmt: skip
    if MASKED:
        k = tl.load(k_ptr + k_off, mask=d_mask[:, None] & n_mask[None, :], other=0.0)  # [D, N]
        v = tl.load(v_ptr + v_off, mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [N, D]
    else:
        k = tl.load(k_ptr + k_off, mask=d_mask[:, None], other=0.0)
        v = tl.load(v_ptr + v_off, mask=d_mask[None, :], other=0.0)
    s = dot(q, k.to(q.dtype), tl.zeros([q.shape[0], pos.shape[0]], tl.float32), UPCAST) * qk_scale  # [M, N]
    if MASKED:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = weighted_values(acc * alpha[:, None], p, v.to(q.dtype), SPLIT_P, UPCAST)
    return acc, m_new, l_i


@triton.jit
def nth_sequence(query_start_ptr, num_seqs, n, DECODES: tl.constexpr, BLOCK: tl.constexpr):
    """Index of the n-th (from 0) of the step's num_seqs sequences whose q_len is 1 (DECODES) or is
    not 1, -1 when there are not n + 1 of them (a grid sized by a bound, not the count): a scan of
    query_start_loc [num_seqs + 1], BLOCK sequences at a time, on the device (no index tensor to
    build on the host for every step)."""
    offs = tl.arange(0, BLOCK)
    found = n * 0 - 1
    seen = n * 0
    for first in range(0, num_seqs, BLOCK):
        b = first + offs
        valid = b < num_seqs
        start = tl.load(query_start_ptr + b, mask=valid, other=0)
        q_len = tl.load(query_start_ptr + b + 1, mask=valid, other=0) - start
        hit = valid & ((q_len == 1) if DECODES else (q_len != 1))
        rank = seen + tl.cumsum(hit.to(tl.int32), 0) - 1  # [BLOCK] rank of each hit among its kind
        found += tl.sum(tl.where(hit & (rank == n), b + 1, 0), 0)
        seen += tl.sum(hit.to(tl.int32), 0)
    return found


@triton.jit
def device_splits(count, KV_HEADS: tl.constexpr, target_programs, max_splits):
    """Partitions per decode when the step's count of decodes is known on the device alone: enough
    (decode, kv head, partition) programs for target_programs, at most max_splits (decode_num_splits'
    rule without its power-of-two rounding)."""
    wanted = tl.cdiv(target_programs, tl.maximum(count, 1) * KV_HEADS)
    return tl.minimum(tl.maximum(wanted, 1), max_splits)


@triton.jit
def partition_len(ctx, num_splits, min_partition, STEP: tl.constexpr):
    """Tokens per partition of a context of ctx tokens: num_splits partitions cover it."""
    part = tl.cdiv(tl.cdiv(ctx, num_splits), STEP) * STEP
    return tl.maximum(part, min_partition)


# no variants per step: Triton would compile one for each int argument equal to 1 or a multiple of
# 16, and the step's size, its block tables' width and its split count are either from step to step
@triton.jit(do_not_specialize=["num_seqs", "bt_stride", "num_splits", "target_programs"])
def _decode_partition_kernel(
    q_ptr,  # [B, nh, d] (VARLEN: the step's [T, nh, d])
    k_ptr,
    v_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    query_start_ptr,  # [B + 1] int32 (VARLEN only)
    work_ptr,  # FLAT only: paged_prefill_attention.bounds_work's list (decode count, then the decodes)
    out_ptr,  # [B, nh * d] (VARLEN: [T, nh * d]) when DIRECT, else partial outputs [decodes, nh, splits, d] fp32
    lse_ptr,  # [decodes, nh, S] fp32, log2 domain
    num_seqs,  # B (VARLEN only)
    q_stride_b,
    q_stride_h,
    bt_stride,
    min_partition,  # tokens: partitions are cdiv(ctx, num_splits) rounded up to STEP, at least this
    num_splits,  # FLAT: the most partitions; the step's own count is chosen on the device (device_splits)
    target_programs,  # FLAT only: device_splits' target
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
    STEP: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    K_TOK_SPLIT: tl.constexpr,
    K_DIM_SPLIT: tl.constexpr,
    V_TOK_SPLIT: tl.constexpr,
    V_DIM_SPLIT: tl.constexpr,
    SPLIT_P: tl.constexpr,
    UPCAST: tl.constexpr,
    DIRECT: tl.constexpr,
    VARLEN: tl.constexpr,
    FLAT: tl.constexpr,  # a work list (VARLEN): a 1-D grid, the split count chosen on the device
    KV_HEADS: tl.constexpr,  # FLAT only
    WORK_HEADER: tl.constexpr,  # FLAT only
    SCAN: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    if FLAT:
        count = tl.load(work_ptr + 1)
        splits = device_splits(count, KV_HEADS, target_programs, num_splits)
        per_decode = KV_HEADS * splits
        idx = tl.program_id(0) // per_decode  # the idx-th decode of the step
        if idx >= count:
            return
        kv_head = tl.program_id(0) % per_decode // splits
        split = tl.program_id(0) % splits
        num_kv_heads = KV_HEADS
    else:
        idx = tl.program_id(0)  # the idx-th decode of the step
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        splits = num_splits
        num_kv_heads = tl.num_programs(1)
    if FLAT:
        seq = tl.load(work_ptr + WORK_HEADER + idx)
        row = tl.load(query_start_ptr + seq).to(tl.int64)  # its query's row of q and out
    elif VARLEN:
        seq = nth_sequence(query_start_ptr, num_seqs, idx, True, SCAN)
        if seq < 0:  # num_decodes was a bound: fewer decodes this step
            return
        row = tl.load(query_start_ptr + seq).to(tl.int64)
    else:
        seq = idx
        row = idx.to(tl.int64)
    ctx = tl.load(context_lens_ptr + seq)
    partition = partition_len(ctx, splits, min_partition, STEP)
    lo = split * partition
    hi = tl.minimum(lo + partition, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    gd_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row * q_stride_b + heads[:, None] * q_stride_h + offs_d[None, :], mask=gd_mask, other=0.0)
    d_mask = offs_d < HEAD_DIM
    table = block_tables_ptr + seq * bt_stride

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_head_off = kv_head * k_head
    v_head_off = kv_head * v_head
    q_pos = tl.zeros([BLOCK_G], tl.int32) + hi  # the query follows the whole context: only hi masks
    for start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, start + offs_n, hi, table, offs_d, d_mask, qk_scale,
            k_ptr, k_head_off, k_blk, k_tok_outer, k_tok_inner, k_dim_outer, k_dim_inner,
            v_ptr, v_head_off, v_blk, v_tok_outer, v_tok_inner, v_dim_outer, v_dim_inner,
            BLOCK_SIZE, K_TOK_SPLIT, K_DIM_SPLIT, V_TOK_SPLIT, V_DIM_SPLIT, SPLIT_P, UPCAST, True,
        )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # an empty context (padding row) gives 0
    if DIRECT:
        o = acc * (v_scale / l_safe)[:, None]
        o_ptr = out_ptr + row * (GROUP * num_kv_heads * HEAD_DIM) + heads[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        part = (idx * GROUP * num_kv_heads + heads) * splits + split  # [G] in [decodes, nh, splits]
        g_written = offs_g < tl.where(lo < ctx, GROUP, 0)  # partitions past the context write nothing
        tl.store(lse_ptr + part, m_i + tl.log2(l_safe), mask=g_written)
        o_ptr = out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(o_ptr, acc / l_safe[:, None], mask=g_written[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "target_programs"])  # no variants per step (above)
def _decode_reduce_kernel(
    partial_ptr,  # [decodes, nh, S, d] fp32
    lse_ptr,  # [decodes, nh, S] fp32
    context_lens_ptr,
    query_start_ptr,  # VARLEN only
    work_ptr,  # FLAT only
    out_ptr,  # [B, nh * d] (VARLEN: [T, nh * d])
    num_seqs,  # VARLEN only
    min_partition,
    num_splits,
    target_programs,  # FLAT only
    v_scale,
    STEP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    VARLEN: tl.constexpr,
    FLAT: tl.constexpr,  # the partition kernel chose each step's split count on the device
    KV_HEADS: tl.constexpr,  # FLAT only
    WORK_HEADER: tl.constexpr,  # FLAT only
    SCAN: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    idx = tl.program_id(0)
    head = tl.program_id(1)
    if FLAT:
        count = tl.load(work_ptr + 1)
        if idx >= count:
            return
        seq = tl.load(work_ptr + WORK_HEADER + idx)
        row = tl.load(query_start_ptr + seq).to(tl.int64)
    elif VARLEN:
        seq = nth_sequence(query_start_ptr, num_seqs, idx, True, SCAN)
        if seq < 0:
            return
        row = tl.load(query_start_ptr + seq).to(tl.int64)
    else:
        seq = idx
        row = idx.to(tl.int64)
    ctx = tl.load(context_lens_ptr + seq)
    if FLAT:  # noqa: SIM108 (count exists only when FLAT: a constexpr branch, not an expression)
        splits = device_splits(count, KV_HEADS, target_programs, num_splits)
    else:
        splits = num_splits
    used = tl.cdiv(ctx, partition_len(ctx, splits, min_partition, STEP))  # partitions stage 1 wrote
    row0 = (idx * tl.num_programs(1) + head) * splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    m_run = tl.full([BLOCK_S], float("-inf"), tl.float32)  # running max, kept as a uniform vector
    l_run = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, used, BLOCK_S):
        s_mask = s0 + offs_s < used
        lse = tl.load(lse_ptr + row0 + s0 + offs_s, mask=s_mask, other=float("-inf"))
        m_new = tl.maximum(m_run, tl.max(lse, 0))
        alpha = tl.exp2(m_run - m_new)
        w = tl.where(s_mask, tl.exp2(lse - m_new), 0.0)  # [S]
        part = tl.load(
            partial_ptr + (row0 + s0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * tl.max(alpha, 0) + tl.sum(w[:, None] * part, 0)
        l_run = l_run * alpha + w
        m_run = m_new
    total = tl.sum(l_run, 0)
    o = acc * (v_scale / tl.where(total > 0.0, total, 1.0))
    tl.store(
        out_ptr + row * (tl.num_programs(1) * HEAD_DIM) + head * HEAD_DIM + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b). Plain ints: triton.cdiv / next_power_of_2 are constexpr functions whose
    calls cost microseconds each, and the wrappers run once per layer per step."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: few programs


def decode_num_splits(batch: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """Partitions per sequence: enough (seq, kv head, partition) programs to fill the GPU, each of
    at least MIN_PARTITION tokens. The batch counts rounded up to a power of two, so a batch and the
    CUDA-graph bucket it is padded to (no bucket range straddles a power of two) get the same
    partitions: graph replay and eager steps sum in the same order and give the same tokens."""
    batch = next_pow2(max(batch, 1))
    wanted = cdiv(TARGET_PROGRAMS_PER_SM * num_sms, batch * num_kv_heads)
    return max(1, min(wanted, cdiv(max_context_len, MIN_PARTITION)))


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    layout: str | KVLayout,
    block_size: int,
    scale: float,
    k_scale: float,
    v_scale: float,
    num_kv_heads: int,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    query_start_loc: torch.Tensor | None = None,
    num_decodes: int | None = None,
    work: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    kv: PagedKV | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Decode-step paged attention: o [B, nh*d] for q [B, nh, d], one query per sequence at position
    context_lens[b] - 1 (it sees the whole cached context).

    k_pool / v_pool are one layer's block pools in `layout` (a name of KV_LAYOUTS or a KVLayout),
    model dtype or fp8 (stored as fp8(x / scale)); block_tables [B, max_blocks] int32, context_lens
    [B] int32 (0 gives a zero row). The context is split into `num_splits` partitions; left None, it
    is chosen from `max_context_len` (a host int bounding context_lens; left None, the block tables'
    capacity) and the GPU's size. Neither reads context_lens, so the call can be captured in a CUDA
    graph; a context longer than max_context_len is still computed right, only with less parallelism.
    config: tile size and launch parameters (DecodeConfig() when None).

    The decode rows of a mixed step: given query_start_loc (int32 [B+1], the step's sequences laid
    end to end in q [T, nh, d], as paged_prefill_attention takes them), only the step's sequences of
    q_len 1 are computed, each into its query's row of o [T, nh*d]; the other rows are left as they
    are. num_decodes (a host int) sizes the grid: their count, or a bound on it (a captured graph's
    step: the programs past the step's decodes return at once).
    work (with query_start_loc; a captured graph's step, whose decodes only the device knows):
    paged_prefill_attention.bounds_work's list, which names the step's decodes; the split count is
    chosen per step on the device from their count (device_splits), up to num_splits (default: what
    one decode would take), over a 1-D grid that covers any count up to num_decodes (a bound of 128
    would otherwise fix one partition for a step of 3 long decodes).
    out: the output to write (o's shape, q's dtype); allocated when None.
    kv: paged_kv(...) of these pools, q's dtype and heads and these scales, when the caller keeps it;
    None computes it. pdl: programmatic dependent launch (kernels/pdl.py).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, nh, d], got {tuple(q.shape)}")
    tokens, nh, d = q.shape
    if kv is None:
        kv = paged_kv(
            layout, q, k_pool, v_pool,
            block_size=block_size, num_kv_heads=num_kv_heads, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    check_block_tables(block_tables, q)
    seqs = block_tables.shape[0]
    varlen = query_start_loc is not None
    if varlen:
        if query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (seqs + 1,):
            raise ValueError(f"query_start_loc must be int32 [{seqs + 1}] (one per block_tables row, plus one)")
        if num_decodes is None or not 0 <= num_decodes <= seqs:
            raise ValueError(f"num_decodes must bound the step's count of q_len 1 sequences, got {num_decodes}")
        batch = num_decodes
    elif seqs != tokens:
        raise ValueError(f"block_tables has {seqs} rows for {tokens} sequences")
    else:
        batch = seqs
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (seqs,):
        raise ValueError(f"context_lens must be int32 [{seqs}]")
    if not max_context_len:  # None or 0 (unknown)
        max_context_len = block_tables.shape[1] * block_size
    flat = work is not None
    if flat and (not varlen or work.dtype != torch.int32):
        raise ValueError("work (an int32 bounds_work list) goes with query_start_loc")
    target = TARGET_PROGRAMS_PER_SM * _num_sms(q.device)
    if num_splits is None:
        count = 1 if flat else batch  # the most partitions any step of the bound could take
        num_splits = decode_num_splits(count, num_kv_heads, max_context_len, _num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    cfg = config or DecodeConfig()
    block_n = cfg.block_n
    min_partition = min(MIN_PARTITION, block_n)  # whole tiles

    if out is None:
        out = torch.empty(tokens, nh * d, dtype=q.dtype, device=q.device)
    elif out.dtype != q.dtype or tuple(out.shape) != (tokens, nh * d) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} [{tokens}, {nh * d}], got {out.dtype} {tuple(out.shape)}")
    if batch == 0:
        return out
    group = nh // num_kv_heads
    direct = num_splits == 1
    # [decodes, nh, splits] rows; with a work list: as many as the step's count and split count take
    rows = max(batch * nh, 2 * target * group) if flat else batch * nh * num_splits
    if direct:
        partial, lse = out, out  # lse unused
    else:
        partial = torch.empty(rows, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows, dtype=torch.float32, device=q.device)
    qsl = query_start_loc if varlen else context_lens  # read only when VARLEN
    block_d = next_pow2(d)
    if flat:
        # device_splits keeps decodes x kv heads x splits under 2 x target once it splits at all
        grid = (max(batch * num_kv_heads, 2 * target if num_splits > 1 else 0),)
    else:
        grid = (batch, num_kv_heads, num_splits)
    _decode_partition_kernel[grid](
        q, k_pool, v_pool, block_tables, context_lens, qsl, work if flat else qsl, partial, lse, seqs,
        q.stride(0), q.stride(1), block_tables.stride(0), min_partition, num_splits, target,
        scale * kv.k_scale * LOG2E, kv.v_scale, *kv.k_args(), *kv.v_args(),
        STEP=block_n, GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, **kv.splits(), SPLIT_P=q.dtype != torch.float32,
        UPCAST=q.device.type != "cuda", DIRECT=direct, VARLEN=varlen, FLAT=flat,
        KV_HEADS=num_kv_heads, WORK_HEADER=WORK_HEADER, SCAN=SCAN_BLOCK, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(pdl),
    )  # fmt: skip
    if not direct:
        _decode_reduce_kernel[(batch, nh)](
            partial, lse, context_lens, qsl, work if flat else qsl, out, seqs, min_partition, num_splits, target,
            kv.v_scale,
            STEP=block_n, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=REDUCE_BLOCK_S,
            VARLEN=varlen, FLAT=flat, KV_HEADS=num_kv_heads, WORK_HEADER=WORK_HEADER, SCAN=SCAN_BLOCK,
            num_warps=4,
            **launch_options(pdl),
        )  # fmt: skip
    return out
