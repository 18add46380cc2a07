"""LL (low-latency) all-reduce over peer memory, alone and fused with the residual add, RMSNorm and
per-token FP8 quantization: the `AllReduce` and `AllReduceAddRMSNorm[Quant]` ops at the smallest
messages (a decode step's few rows), where the one-shot kernel's barrier is most of the time.

The one-shot kernel (custom_allreduce.py) copies x into its own region, meets every rank at a barrier
(a system-scope fence, a signal written to every peer, a wait for theirs) and then reads every peer's
copy across the links: a fence, a one-way signal and a round trip per call. Here, as in NCCL's LL
protocol, each 4 bytes of x travel with a flag in one 8-byte word, pushed into every peer's LL area:

    word = flag << 32 | the 4 bytes of x (two 16-bit elements, or one fp32)

The receiver spins on its own area (volatile loads, local memory) until every word it needs carries
the call's flag, and sums the data halves, so a call costs one one-way trip over the links and no
fence: an 8-byte store is seen whole or not at all, data and flag together.

Layout of a rank's LL area (int64 words, after the data halves of peer_sync.py's region):
[2 parities][WORLD sources][words]; a call in parity p writes its words into [p][RANK] of every peer
and reads [p][r] of its own area. Program s of a call moves the same words on every rank (the grid
and the split depend only on the shape), with the count of its slot (peer_sync.call_counts), whose
parity alternates between calls as the one-shot's data halves do and for the same reason (a rank
can be at most one call ahead of a peer that still reads). The flag is that count, made positive and
nonzero; a receiver sets each word back to zero once read, so a stale word never holds a flag (the
next write to it comes two calls later, after this kernel ended).

Numerics are the one-shot kernel's: D(sum_r fp32(x_r)) in rank order (this rank's own x read from its
input), the same bits on every rank; the fused kernel then follows add_rmsnorm_quant.py's rounding
exactly. Waits are bounded as peer_sync.py says (the host's abort word once a wait has lasted
POLL_AFTER_NS, a trap past the timeout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qruntime.kernels.add_rmsnorm_quant import normalize_row
from qruntime.kernels.custom_allreduce import fused_outputs
from qruntime.kernels.dynamic_quant import MAX_BLOCK, check_model_dtype, round_to, row_config, use_hw_casts
from qruntime.kernels.pdl import launch_options, wait_for_inputs
from qruntime.kernels.peer_sync import Peers, bounded_wait, call_counts, global_timer_ns, grid_of

BLOCK_WORDS = 1024  # words a program moves at once in the plain all-reduce
WORD_BYTES = 4  # bytes of x a word carries


@triton.jit
def _flag(count):
    """The call's flag: its slot count as a positive, nonzero 31-bit number (a reset word is 0)."""
    return count % 2147483647 + 1


@triton.jit
def _area(ll, parity, source, words, WORLD: tl.constexpr):
    """Words [parity][source] of the LL area at `ll`."""
    return ll + (parity * WORLD + source) * words


@triton.jit
def _push(src, ll, ll_deltas, dst, mask, flag, parity, words, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Store the int32 words at src, each with the flag, at offsets dst of this rank's part of every
    peer's LL area."""
    word = (flag << 32) | (tl.load(src, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF)
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer = _area(ll + tl.load(ll_deltas + r), parity, RANK, words, WORLD)
            tl.store(peer + dst, word, mask=mask)


@triton.jit
def _receive(
    ll, source, dst, mask, flag, parity, words, timeout_ns, abort, alive, WORLD: tl.constexpr, HW: tl.constexpr
):
    """(the int32 data of the words at offsets dst from rank `source`, alive): waits until each carries
    the flag, then sets them back to zero. alive becomes 0 (and the data garbage) when the host raised
    the abort word while this waited; a wait past timeout_ns traps."""
    at = _area(ll, parity, source, words, WORLD) + dst
    word = tl.load(at, mask=mask, other=0, volatile=True)
    ready = tl.min((((word >> 32) == flag) | (mask == 0)).to(tl.int32), axis=0)
    aborted = abort.to(tl.pointer_type(tl.int32))  # a host word (pinned, mapped): set when a rank died
    if HW:
        start = global_timer_ns()
        spins = 0
        while (ready == 0) & (alive != 0):
            spins += 1
            if spins % 64 == 0:
                alive = bounded_wait(start, alive, timeout_ns, aborted)
            word = tl.load(at, mask=mask, other=0, volatile=True)
            ready = tl.min((((word >> 32) == flag) | (mask == 0)).to(tl.int32), axis=0)
    else:
        while (ready == 0) & (alive != 0):
            if tl.load(aborted, volatile=True) != 0:
                alive = 0
            word = tl.load(at, mask=mask, other=0, volatile=True)
            ready = tl.min((((word >> 32) == flag) | (mask == 0)).to(tl.int32), axis=0)
    tl.store(at, tl.zeros_like(word), mask=mask)
    return word.to(tl.int32), alive


@triton.jit
def _values(data, DT: tl.constexpr, EPW: tl.constexpr, BW: tl.constexpr):
    """The elements of BW int32 words as fp32, in memory order: two 16-bit values a word (low half
    first) when EPW is 2, one fp32 when it is 1."""
    if EPW == 2:
        low = data.to(tl.int16).to(DT, bitcast=True)
        high = (data >> 16).to(tl.int16).to(DT, bitcast=True)
        return tl.reshape(tl.join(low, high), [2 * BW]).to(tl.float32)
    else:
        return data.to(DT, bitcast=True).to(tl.float32)


@triton.jit
def _ll_kernel(
    xw_ptr,  # [n_words] int32: x's bytes, contiguous
    out_ptr,  # [n_words * EPW] model dtype, contiguous (may be x)
    n_words,
    ll,  # int64: this rank's LL area
    ll_deltas,  # [WORLD] int64: rank r's LL area minus this rank's, in words
    words,  # words of one [parity][source] part
    counters,  # [MAX_SLOTS] int64, this rank's
    timeout_ns,
    abort,  # int64: address of the host's abort word
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    EPW: tl.constexpr,  # elements a word carries
    BW: tl.constexpr,  # words a program moves at once
    HW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    slot = tl.program_id(0)
    step = tl.num_programs(0) * BW
    _, count, parity = call_counts(counters, slot)
    tl.store(counters + slot, count)
    flag = _flag(count)
    offs = tl.arange(0, BW)
    for start in range(slot * BW, n_words, step):
        idx = tl.multiple_of(start, BW) + offs
        _push(xw_ptr + idx, ll, ll_deltas, idx, idx < n_words, flag, parity, words, RANK, WORLD)
    alive = 1
    elems = tl.arange(0, BW * EPW)
    for start in range(slot * BW, n_words, step):
        idx = tl.multiple_of(start, BW) + offs
        mask = idx < n_words
        acc = tl.zeros([BW * EPW], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                data = tl.load(xw_ptr + idx, mask=mask, other=0)
            else:
                data, alive = _receive(ll, r, idx, mask, flag, parity, words, timeout_ns, abort, alive, WORLD, HW)
            acc += _values(data, DT, EPW, BW)
        at = start * EPW + elems
        tl.store(out_ptr + at, round_to(acc, DT, HW).to(DT), mask=at < n_words * EPW)  # exact: a DT value


@triton.jit
def _ll_fused_kernel(
    xw_ptr,  # [T, H / EPW] int32: the rank's partial sum's bytes, unit column stride
    r_ptr,  # [T, H] residual (unused without HAS_RES)
    w_ptr,  # [H]
    ro_ptr,  # [T, H] residual_out, contiguous (the summed x itself without HAS_RES)
    y_ptr,  # [T, H] uint8 codes when QUANT, else y in the model dtype; contiguous
    s_ptr,  # [T] fp32 scales (unused without QUANT)
    T,
    H,
    stride_xw,  # words
    stride_r,
    eps,
    ll,
    ll_deltas,
    words,
    counters,
    timeout_ns,
    abort,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HAS_RES: tl.constexpr,
    QUANT: tl.constexpr,
    EPW: tl.constexpr,
    BLOCK: tl.constexpr,  # a row's elements in one tile (BLOCK / EPW words)
    HW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    DT: tl.constexpr = ro_ptr.dtype.element_ty
    BW: tl.constexpr = BLOCK // EPW
    slot = tl.program_id(0)
    grid = tl.num_programs(0)
    _, count, parity = call_counts(counters, slot)
    tl.store(counters + slot, count)
    flag = _flag(count)
    row_words = H // EPW
    wcols = tl.arange(0, BW)
    wmask = wcols < row_words
    for row in range(slot, T, grid):  # int32 offsets: a message holds at most `words` words
        _push(xw_ptr + row * stride_xw + wcols, ll, ll_deltas, row * row_words + wcols, wmask, flag, parity, words, RANK, WORLD)  # fmt: skip
    alive = 1
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    for row in range(slot, T, grid):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                data = tl.load(xw_ptr + row * stride_xw + wcols, mask=wmask, other=0)
            else:
                dst = row * row_words + wcols
                data, alive = _receive(ll, r, dst, wmask, flag, parity, words, timeout_ns, abort, alive, WORLD, HW)
            acc += _values(data, DT, EPW, BW)
        h = round_to(acc, DT, HW)
        if HAS_RES:
            h = round_to(h + tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32), DT, HW)
        tl.store(ro_ptr + row * H + cols, h.to(DT), mask=mask)
        normalize_row(h, w_ptr, cols, mask, y_ptr + row * H, s_ptr + row, H, eps, QUANT, DT, HW)


def _elements_per_word(x: torch.Tensor) -> int:
    return WORD_BYTES // x.element_size()


def fits_ll(x: torch.Tensor, peers: Peers) -> bool:
    """Whether the LL kernel takes x: contiguous, the peers' dtype, whole words, at most the LL area's."""
    nbytes = x.numel() * x.element_size()
    return (
        peers.ll is not None
        and x.is_contiguous()
        and x.dtype == peers.data.dtype
        and nbytes % WORD_BYTES == 0
        and x.data_ptr() % WORD_BYTES == 0
        and nbytes // WORD_BYTES <= peers.ll_words
    )


def fits_ll_fused(x: torch.Tensor, peers: Peers) -> bool:
    """Whether the fused LL kernel takes x [T, H]: unit column stride, rows of whole words starting on
    a word, a row in one register tile, the message in the LL area."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] > MAX_BLOCK or peers.ll is None or x.dtype != peers.data.dtype:
        return False
    row_bytes, stride_bytes = x.shape[1] * x.element_size(), x.stride(0) * x.element_size()
    whole = row_bytes % WORD_BYTES == 0 and stride_bytes % WORD_BYTES == 0 and x.data_ptr() % WORD_BYTES == 0
    return whole and x.shape[0] * row_bytes // WORD_BYTES <= peers.ll_words


def _ll_args(peers: Peers) -> tuple:
    return (peers.ll, peers.ll_deltas, peers.ll_words, peers.counters, peers.timeout_ns, peers.abort.data_ptr())


def ll_all_reduce(x: torch.Tensor, peers: Peers, out: torch.Tensor | None = None, *, pdl: bool = False) -> torch.Tensor:
    """The sum over the ranks of their x (fits_ll) into `out` (a new tensor by default; x itself is
    allowed). Every rank calls it with the same shape."""
    check_model_dtype("x", x)
    if not fits_ll(x, peers):
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} must be contiguous, {peers.data.dtype}, whole {WORD_BYTES}-byte words, "
            f"at most {peers.ll_words} words"
        )
    out = torch.empty_like(x) if out is None else out
    n_words = x.numel() * x.element_size() // WORD_BYTES
    if n_words:
        _ll_kernel[(grid_of(triton.cdiv(n_words, BLOCK_WORDS)),)](
            x.view(-1).view(torch.int32), out, n_words, *_ll_args(peers),
            RANK=peers.rank, WORLD=peers.world, EPW=_elements_per_word(x), BW=BLOCK_WORDS, HW=use_hw_casts(x),
            num_warps=8, **launch_options(pdl),
        )  # fmt: skip
    return out


def ll_all_reduce_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    quant: bool,
    peers: Peers,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, ...]:
    """custom_allreduce.all_reduce_add_rmsnorm through the LL kernel (fits_ll_fused): the same
    outputs, the same bits."""
    check_model_dtype("x", x)
    if not fits_ll_fused(x, peers):
        raise ValueError(
            f"x {tuple(x.shape)} (strides {x.stride()}) does not fit the fused LL kernel (rows of whole "
            f"{WORD_BYTES}-byte words, <= {MAX_BLOCK} columns, <= {peers.ll_words} words)"
        )
    tokens, hidden = x.shape
    y, ys, residual_out = fused_outputs(x, residual, w, quant)
    if tokens:
        epw = _elements_per_word(x)
        block, _, num_warps = row_config(hidden)
        has_res = residual is not None
        xw = x.view(torch.int32)  # [T, H / EPW], its row stride in words
        _ll_fused_kernel[(grid_of(tokens),)](
            xw, residual if has_res else x, w.contiguous(), residual_out,
            y.view(torch.uint8) if quant else y, ys if quant else residual_out,
            tokens, hidden, xw.stride(0), residual.stride(0) if has_res else 0, float(eps), *_ll_args(peers),
            RANK=peers.rank, WORLD=peers.world, HAS_RES=has_res, QUANT=quant, EPW=epw, BLOCK=max(block, epw),
            HW=use_hw_casts(x), num_warps=num_warps, **launch_options(pdl),
        )  # fmt: skip
    return (y, ys, residual_out) if quant else (y, residual_out)
