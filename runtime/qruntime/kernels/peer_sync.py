"""What the custom all-reduce kernels share (kernels/custom_allreduce.py: one-shot and fused;
kernels/two_shot_allreduce.py): the layout of every rank's peer-memory region, the barrier that meets
the same program of every rank, and the Peers a launch takes.

Every rank owns a region that every other rank has mapped (CUDA IPC on GPUs, a shared file in the
CPU tests; qruntime.comm.peer_memory): `bases[r]` is rank r's region in this process's address space.

    region = signals int64 [MAX_SLOTS, MAX_WORLD] | data half 0 | data half 1 | LL area
    (data at DATA_OFFSET; the LL area, int64 words of the LL kernels, after the data halves: ll_allreduce.py)

A call runs `grid` programs (slots). Each call takes two counts of its slot (`call_counts`: the
counters live in device memory, so a captured graph replays correctly): c1 = counters[s] + 1 and
c2 = c1 + 1, and writes into data half (c2 / 2) % 2, so consecutive calls alternate halves. At a
barrier, program s writes its count into slot s of every rank's signals (one system-scope fence,
then relaxed system-scope stores) and waits until every rank's count in its own slot s is >= the count
(acquire); a one-shot call meets once (at c2), a two-shot call twice (c1, c2).

Why that suffices: program s of a call writes half h, last written two calls before; every peer
finished reading it there before it signalled the call in between in slot s (stream order), and this
program waited for that signal before the call in between ended. A peer is at most one count ahead in
a slot (it needs this rank's signal to pass), so `>=` never misses. Programs only ever read what the
same slot of every rank wrote, so per-slot barriers are enough (a block b is always slot b % grid's).

A wait is bounded: the host can raise an abort word (pinned host memory, polled every 256 spins once
a wait has lasted POLL_AFTER_NS, never in the microsecond waits of a healthy group; rank 0 raises it
when a worker process dies), which ends the wait and makes the caller skip its reads (the
result is then garbage, and the host raises instead of returning it); past `timeout_ns` (the GPU's
global timer) the program traps, so a peer that hung becomes a CUDA error instead of a kernel spinning
forever. Under Triton's interpreter (CI) there is no timer and no trap; the tests run the ranks as
processes over shared files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_SLOTS = 128  # programs of one call: each its own signal slot and count
MAX_WORLD = 8
SIGNAL_BYTES = MAX_SLOTS * MAX_WORLD * 8  # int64 counts
DATA_OFFSET = -(-SIGNAL_BYTES // 4096) * 4096  # data halves start past the signals, 16-byte aligned
_MAX_WORLD = tl.constexpr(MAX_WORLD)  # the kernels' view of it
POLL_AFTER_NS = tl.constexpr(1_000_000)  # a wait longer than this starts polling the host's abort word


@triton.jit
def global_timer_ns():
    """The GPU's global timer (ns)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def trap():
    """End the kernel with an error (a CUDA launch failure on the host)."""
    tl.inline_asm_elementwise("trap;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_sys():
    """fence.acq_rel.sys: this thread's earlier writes (and, after the CTA barrier, its CTA's) are
    seen by every GPU before its later ones."""
    tl.inline_asm_elementwise("fence.acq_rel.sys;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def call_counts(counters, slot):
    """(c1, c2, half) of this call in `slot`: its two counts and the data half it writes."""
    c1 = tl.load(counters + slot) + 1
    c2 = c1 + 1
    return c1, c2, (c2 // 2) % 2


@triton.jit
def data_half(data, deltas, rank, parity, half):
    """Data half `parity` of rank `rank`'s region: this rank's data pointer moved by the other's
    distance (elements, a multiple of 8: 16-byte aligned, so loads and stores stay vectorized)."""
    return data + tl.multiple_of(tl.load(deltas + rank), 8) + parity * half


@triton.jit
def bounded_wait(start, alive, timeout_ns, aborted):
    """A wait's periodic check (the GPU branch; `start` its global_timer_ns): alive becomes 0 once the
    host raised the abort word (pinned memory at `aborted`), read only when the wait has lasted
    POLL_AFTER_NS; past timeout_ns the program traps."""
    waited = global_timer_ns() - start
    # the host word is a read across PCIe by every thread of every waiting program: in the waits of
    # a healthy group (microseconds) it is never read, since reading it there made 128-program calls
    # ~150x slower (966 us for 512 KB on 2 x H200)
    if waited > POLL_AFTER_NS:  # noqa: SIM102 (nested: the load must not run when false)
        if tl.load(aborted, volatile=True) != 0:
            alive = 0
    if waited > timeout_ns:
        trap()
    return alive


@triton.jit
def barrier(bases, counters, slot, count, timeout_ns, abort, RANK: tl.constexpr, WORLD: tl.constexpr, HW: tl.constexpr):
    """Meet program `slot` of every rank: publish `count`, wait for every rank's (see the module doc).
    Returns 0 when the host raised the abort word (a rank died) while it waited, else 1."""
    tl.store(counters + slot, count)
    tl.debug_barrier()  # every thread's data stores happen before the signal
    if HW:  # one system-scope fence, then relaxed signals (a release on each would fence each)
        fence_sys()
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
            start = global_timer_ns()
            spins = 0
            while (seen < count) & (alive != 0):
                spins += 1
                if spins % 256 == 0:
                    alive = bounded_wait(start, alive, timeout_ns, aborted)
                seen = tl.atomic_add(mine + r, 0, sem="acquire", scope="sys")
        else:
            while (seen < count) & (alive != 0):
                if tl.load(aborted, volatile=True) != 0:
                    alive = 0
                seen = tl.atomic_add(mine + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    return alive


def grid_of(units: int) -> int:
    """Programs of a launch over `units` blocks or rows: one per unit, at most MAX_SLOTS."""
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
    ll: torch.Tensor | None = None  # [2 * world * ll_words] int64: this rank's LL area (None: no LL kernel)
    ll_deltas: torch.Tensor | None = None  # [world] int64: rank r's LL area minus this rank's, in words

    def __post_init__(self) -> None:
        if not 2 <= self.world <= MAX_WORLD or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} of {self.world}: the custom all-reduce takes 2..{MAX_WORLD} ranks")
        for name, t, shape in (("deltas", self.deltas, (self.world,)), ("bases", self.bases, (self.world,))):
            if t.shape != shape or t.dtype != torch.int64:
                raise ValueError(f"{name} must be [{self.world}] int64, got {tuple(t.shape)} {t.dtype}")
        if self.counters.shape != (MAX_SLOTS,) or self.counters.dtype != torch.int64:
            raise ValueError(f"counters must be [{MAX_SLOTS}] int64, got {tuple(self.counters.shape)}")
        if self.ll is not None:
            ll, deltas = self.ll, self.ll_deltas
            if ll.dtype != torch.int64 or ll.dim() != 1 or ll.numel() % (2 * self.world):
                raise ValueError(f"ll must be [2 * {self.world} * words] int64, got {tuple(ll.shape)} {ll.dtype}")
            if deltas is None or deltas.shape != (self.world,) or deltas.dtype != torch.int64:
                raise ValueError(f"ll_deltas must be [{self.world}] int64 beside ll")

    @property
    def ll_words(self) -> int:
        """Words of one [parity][source] part of the LL area: the LL kernels' largest message (0: none)."""
        return 0 if self.ll is None else self.ll.numel() // (2 * self.world)

    @property
    def half(self) -> int:
        """Elements of one data half: the largest message."""
        return self.data.numel() // 2

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.data.dtype and x.numel() <= self.half

    def check_message(self, x: torch.Tensor) -> None:
        """ValueError unless x can be all-reduced through the regions: contiguous, their dtype, at most a data half."""
        if not x.is_contiguous() or not self.fits(x):
            raise ValueError(
                f"x {tuple(x.shape)} {x.dtype} must be contiguous, {self.data.dtype}, at most {self.half} elements"
            )
