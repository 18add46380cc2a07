"""One-shot all-reduce over peer memory, alone and fused with the residual add, RMSNorm and per-token
FP8 quantization that follow every row-parallel output (the `AllReduce` and `AllReduceAddRMSNorm[Quant]`
ops at decode-sized messages; NCCL takes the large ones, qruntime.comm.all_reduce chooses).

Every rank owns a region that every other rank has mapped (CUDA IPC on GPUs, a shared file in the
CPU tests; qruntime.comm.peer_memory): `bases[r]` is rank r's region in this process's address space.

    region = signals int64 [MAX_SLOTS, MAX_WORLD] | data half 0 | data half 1     (data at DATA_OFFSET)

A call runs `grid` programs (slots). Program s copies its share of this rank's x (elements
s*BLOCK.., every grid*BLOCK, or rows s, s+grid, ...) into this rank's data half `c % 2`, then meets
program s of every rank at a barrier: it bumps its own count c = counters[s] + 1 (device memory, so a
captured graph replays correctly), writes c into slot s of every rank's signals (release, system scope)
and waits until every rank's count in its own slot s is >= c (acquire). It then reads its share from
every rank's half `c % 2` and sums it in fp32, rank 0 first, so every rank gets the same bits.

Why one barrier suffices: program s of call c writes half c % 2, last written at count c - 2; every
peer finished reading that (count c - 2) before it signalled count c - 1 in slot s (stream order),
and this program waited for that signal before its call c - 1 ended. A peer is at most one count
ahead in a slot (it needs this rank's signal to pass), so `>= c` never misses.

Numerics: the sum is D(sum_r fp32(x_r)) in rank order, D the model dtype: at two ranks exactly what
NCCL and the reference give (one addition); at more, the fp32 sum is at least as exact as a chain of
D additions. The fused kernel then follows add_rmsnorm_quant.py's rounding order exactly.

A wait is bounded: the host can raise an abort word (pinned host memory the kernel polls every 256
spins; rank 0 raises it when a worker process dies), which ends the wait and skips the sum (the
result is then garbage, and the host raises instead of returning it); and past `timeout_ns` (the
GPU's global timer) the program traps, so a peer that hung turns into a CUDA error instead of a
kernel spinning forever. Under Triton's interpreter
(CI) there is no timer and no trap; the tests run the ranks as processes over shared files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qruntime.kernels.add_rmsnorm_quant import normalize_row
from qruntime.kernels.dynamic_quant import FP8, MAX_BLOCK, check_model_dtype, round_to, row_config, use_hw_casts

MAX_SLOTS = 128  # programs of one call: each its own signal slot and count
MAX_WORLD = 8
SIGNAL_BYTES = MAX_SLOTS * MAX_WORLD * 8  # int64 counts
DATA_OFFSET = -(-SIGNAL_BYTES // 4096) * 4096  # data halves start past the signals, 16-byte aligned
BLOCK = 2048  # elements a program moves at once in the plain all-reduce
_MAX_WORLD = tl.constexpr(MAX_WORLD)  # the kernels' views of the layout
_DATA_OFFSET = tl.constexpr(DATA_OFFSET)


@triton.jit
def _global_timer_ns():
    """The GPU's global timer (ns)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trap():
    """End the kernel with an error (a CUDA launch failure on the host)."""
    tl.inline_asm_elementwise("trap;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fence_sys():
    """fence.acq_rel.sys: this thread's earlier writes (and, after the CTA barrier, its CTA's) are
    seen by every GPU before its later ones."""
    tl.inline_asm_elementwise("fence.acq_rel.sys;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _next_count(counters, slot):
    return tl.load(counters + slot) + 1


@triton.jit
def _data_half(data, deltas, rank, parity, half):
    """Data half `parity` of rank `rank`'s region: this rank's data pointer moved by the other's
    distance (elements, a multiple of 8: 16-byte aligned, so loads and stores stay vectorized)."""
    return data + tl.multiple_of(tl.load(deltas + rank), 8) + parity * half


@triton.jit
def _barrier(
    bases, counters, slot, count, timeout_ns, abort, RANK: tl.constexpr, WORLD: tl.constexpr, HW: tl.constexpr
):
    """Meet program `slot` of every rank: publish `count`, wait for every rank's (see the module doc).
    Returns 0 when the host raised the abort word (a rank died) while it waited, else 1."""
    tl.store(counters + slot, count)
    tl.debug_barrier()  # every thread's data stores happen before the signal
    if HW:  # one system-scope fence, then relaxed signals (a release on each would fence each)
        _fence_sys()
        for r in tl.static_range(WORLD):
            signals = tl.load(bases + r).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(signals + slot * _MAX_WORLD + RANK, count, sem="relaxed", scope="sys")
    else:
        for r in tl.static_range(WORLD):
            signals = tl.load(bases + r).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(signals + slot * _MAX_WORLD + RANK, count, sem="release", scope="sys")
    mine = tl.load(bases + RANK).to(tl.pointer_type(tl.int64)) + slot * _MAX_WORLD
    aborted = abort.to(tl.pointer_type(tl.int32))  # a host word (pinned, mapped): set when a rank died
    alive = 1
    for r in tl.static_range(WORLD):
        seen = tl.atomic_add(mine + r, 0, sem="acquire", scope="sys")
        if HW:
            start = _global_timer_ns()
            spins = 0
            while (seen < count) & (alive != 0):
                spins += 1
                if spins % 256 == 0:  # a read across PCIe: not on every spin
                    if tl.load(aborted, volatile=True) != 0:
                        alive = 0
                    if _global_timer_ns() - start > timeout_ns:
                        _trap()
                seen = tl.atomic_add(mine + r, 0, sem="acquire", scope="sys")
        else:
            while (seen < count) & (alive != 0):
                if tl.load(aborted, volatile=True) != 0:
                    alive = 0
                seen = tl.atomic_add(mine + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    return alive


@triton.jit
def _one_shot_kernel(
    x_ptr,  # [n] contiguous, model dtype
    out_ptr,  # [n] contiguous (may be x)
    n,
    data,  # this rank's data halves, typed as x: [2 * half]
    deltas,  # [WORLD] int64: rank r's data minus this rank's, in elements
    half,  # elements of a data half
    bases,  # [WORLD] int64: every rank's region in this process (the signals)
    counters,  # [MAX_SLOTS] int64, this rank's
    timeout_ns,
    abort,  # int64: address of the host's abort word
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    HW: tl.constexpr,
):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    slot = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    count = _next_count(counters, slot)
    parity = count % 2
    mine = data + parity * half
    offs = tl.arange(0, BLOCK)
    for start in range(slot * BLOCK, n, step):
        idx = tl.multiple_of(start, BLOCK) + offs
        mask = idx < n
        tl.store(mine + idx, tl.load(x_ptr + idx, mask=mask), mask=mask)
    alive = _barrier(bases, counters, slot, count, timeout_ns, abort, RANK, WORLD, HW)
    for start in range(slot * BLOCK, n * alive, step):  # nothing read from a dead rank
        idx = tl.multiple_of(start, BLOCK) + offs
        mask = idx < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            peer = _data_half(data, deltas, r, parity, half)
            acc += tl.load(peer + idx, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + idx, round_to(acc, DT, HW).to(DT), mask=mask)  # exact: a DT value


@triton.jit
def _fused_kernel(
    x_ptr,  # [T, H] the rank's partial sum, unit column stride
    r_ptr,  # [T, H] residual (unused without HAS_RES)
    w_ptr,  # [H]
    ro_ptr,  # [T, H] residual_out, contiguous (the summed x itself without HAS_RES)
    y_ptr,  # [T, H] uint8 codes when QUANT, else y in the model dtype; contiguous
    s_ptr,  # [T] fp32 scales (unused without QUANT)
    T,
    H,
    stride_x,
    stride_r,
    eps,
    data,
    deltas,
    half,
    bases,
    counters,
    timeout_ns,
    abort,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HAS_RES: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    HW: tl.constexpr,
):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    slot = tl.program_id(0)
    grid = tl.num_programs(0)
    count = _next_count(counters, slot)
    parity = count % 2
    mine = data + parity * half
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    for row in range(slot, T, grid):  # int32 offsets: a message holds at most a data half
        tl.store(mine + row * H + cols, tl.load(x_ptr + row * stride_x + cols, mask=mask), mask=mask)
    alive = _barrier(bases, counters, slot, count, timeout_ns, abort, RANK, WORLD, HW)
    for row in range(slot, T * alive, grid):  # nothing read from a dead rank
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            peer = _data_half(data, deltas, r, parity, half)
            acc += tl.load(peer + row * H + cols, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        h = round_to(acc, DT, HW)
        if HAS_RES:
            h = round_to(h + tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32), DT, HW)
        tl.store(ro_ptr + row * H + cols, h.to(DT), mask=mask)
        normalize_row(h, w_ptr, cols, mask, y_ptr + row * H, s_ptr + row, H, eps, QUANT, DT, HW)


def _grid(units: int) -> int:
    return max(1, min(units, MAX_SLOTS))


@dataclass(frozen=True)
class Peers:
    """What the kernels take of the group's regions (qruntime.comm.peer_memory), for one dtype."""

    data: torch.Tensor  # [2 * half] this rank's two data halves, in the model dtype
    deltas: torch.Tensor  # [world] int64: rank r's data halves minus this rank's, in elements
    bases: torch.Tensor  # [world] int64: every rank's region (signals at its start)
    counters: torch.Tensor  # [MAX_SLOTS] int64: this rank's count per slot
    rank: int
    world: int
    timeout_ns: int  # a wait for a peer longer than this traps
    abort: torch.Tensor  # [1] int32 in pinned host memory (CPU memory in the tests): nonzero stops waits

    def __post_init__(self) -> None:
        if not 2 <= self.world <= MAX_WORLD or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} of {self.world}: the custom all-reduce takes 2..{MAX_WORLD} ranks")
        for name, t, shape in (("deltas", self.deltas, (self.world,)), ("bases", self.bases, (self.world,))):
            if t.shape != shape or t.dtype != torch.int64:
                raise ValueError(f"{name} must be [{self.world}] int64, got {tuple(t.shape)} {t.dtype}")
        if self.counters.shape != (MAX_SLOTS,) or self.counters.dtype != torch.int64:
            raise ValueError(f"counters must be [{MAX_SLOTS}] int64, got {tuple(self.counters.shape)}")

    @property
    def half(self) -> int:
        """Elements of one data half: the largest message."""
        return self.data.numel() // 2

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.data.dtype and x.numel() <= self.half


def one_shot_all_reduce(x: torch.Tensor, peers: Peers, out: torch.Tensor | None = None) -> torch.Tensor:
    """The sum over the ranks of their x (contiguous, the peers' dtype, at most a data half) into
    `out` (a new tensor by default; x itself is allowed). Every rank calls it with the same shape."""
    check_model_dtype("x", x)
    if not x.is_contiguous() or not peers.fits(x):
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} must be contiguous, {peers.data.dtype}, at most {peers.half} elements"
        )
    out = torch.empty_like(x) if out is None else out
    n = x.numel()
    if n:
        _one_shot_kernel[(_grid(triton.cdiv(n, BLOCK)),)](
            x, out, n, peers.data, peers.deltas, peers.half, peers.bases, peers.counters, peers.timeout_ns,
            peers.abort.data_ptr(), RANK=peers.rank, WORLD=peers.world, BLOCK=BLOCK, HW=use_hw_casts(x), num_warps=8,
        )  # fmt: skip
    return out


def fits_fused(x: torch.Tensor, peers: Peers) -> bool:
    """Whether the fused kernel takes x [T, H]: unit column stride, a row in one register tile, the
    message in a data half."""
    return x.dim() == 2 and x.stride(1) == 1 and x.shape[1] <= MAX_BLOCK and peers.fits(x)


def all_reduce_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float, quant: bool, peers: Peers
) -> tuple[torch.Tensor, ...]:
    """AddRMSNorm[Quant] (add_rmsnorm_quant.py) of the sum over the ranks of their x [T, H]:
    quant -> (yq fp8 [T, H], ys fp32 [T, 1], residual_out [T, H]); else (y [T, H], residual_out)."""
    check_model_dtype("x", x)
    if not fits_fused(x, peers):
        raise ValueError(
            f"x {tuple(x.shape)} does not fit the fused kernel (rows <= {MAX_BLOCK}, <= {peers.half} elements)"
        )
    tokens, hidden = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype} with unit column stride")
    if w.shape != (hidden,) or w.dtype != x.dtype:
        raise ValueError(f"w must be [{hidden}] {x.dtype}, got {tuple(w.shape)} {w.dtype}")
    residual_out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if quant:
        y = torch.empty(tokens, hidden, dtype=FP8, device=x.device)
        ys = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
        ys = None
    if tokens:
        block, _, num_warps = row_config(hidden)
        has_res = residual is not None
        _fused_kernel[(_grid(tokens),)](
            x, residual if has_res else x, w.contiguous(), residual_out,
            y.view(torch.uint8) if quant else y, ys if quant else residual_out,
            tokens, hidden, x.stride(0), residual.stride(0) if has_res else 0, float(eps),
            peers.data, peers.deltas, peers.half, peers.bases, peers.counters, peers.timeout_ns,
            peers.abort.data_ptr(), RANK=peers.rank, WORLD=peers.world, HAS_RES=has_res, QUANT=quant, BLOCK=block, HW=use_hw_casts(x),
            num_warps=num_warps,
        )  # fmt: skip
    return (y, ys, residual_out) if quant else (y, residual_out)
