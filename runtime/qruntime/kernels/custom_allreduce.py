"""One-shot all-reduce over peer memory, alone and fused with the residual add, RMSNorm and per-token
FP8 quantization that follow every row-parallel output (the `AllReduce` and `AllReduceAddRMSNorm[Quant]`
ops at decode-sized messages; NCCL takes the large ones, qruntime.comm.all_reduce chooses).

A call runs one program per block of BLOCK elements (or per row), at most MAX_SLOTS (peer_sync.py has
the regions, the counts and the barrier). Program s copies its share of this rank's x (elements
s*BLOCK.., every grid*BLOCK, or rows s, s+grid, ...) into this rank's data half, meets program s of
every rank at one barrier, then reads its share from every rank's half and sums it in fp32, rank 0
first, so every rank gets the same bits.

Numerics: the sum is D(sum_r fp32(x_r)) in rank order, D the model dtype: at two ranks exactly what
NCCL and the reference give (one addition); at more, the fp32 sum is at least as exact as a chain of
D additions. The fused kernel then follows add_rmsnorm_quant.py's rounding order exactly.

Waits are bounded as peer_sync.py says.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qruntime.kernels.add_rmsnorm_quant import normalize_row
from qruntime.kernels.dynamic_quant import FP8, MAX_BLOCK, check_model_dtype, round_to, row_config, use_hw_casts
from qruntime.kernels.pdl import launch_options, wait_for_inputs
from qruntime.kernels.peer_sync import Peers, barrier, call_counts, data_half, grid_of

BLOCK = 2048  # elements a program moves at once in the plain all-reduce


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
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    slot = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    _, count, parity = call_counts(counters, slot)  # one barrier, at the call's second count
    mine = data + parity * half
    offs = tl.arange(0, BLOCK)
    for start in range(slot * BLOCK, n, step):
        idx = tl.multiple_of(start, BLOCK) + offs
        mask = idx < n
        tl.store(mine + idx, tl.load(x_ptr + idx, mask=mask), mask=mask)
    alive = barrier(bases, counters, slot, count, timeout_ns, abort, RANK, WORLD, HW)
    for start in range(slot * BLOCK, n * alive, step):  # nothing read from a dead rank
        idx = tl.multiple_of(start, BLOCK) + offs
        mask = idx < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            peer = data_half(data, deltas, r, parity, half)
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
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    slot = tl.program_id(0)
    grid = tl.num_programs(0)
    _, count, parity = call_counts(counters, slot)  # one barrier, at the call's second count
    mine = data + parity * half
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    for row in range(slot, T, grid):  # int32 offsets: a message holds at most a data half
        tl.store(mine + row * H + cols, tl.load(x_ptr + row * stride_x + cols, mask=mask), mask=mask)
    alive = barrier(bases, counters, slot, count, timeout_ns, abort, RANK, WORLD, HW)
    for row in range(slot, T * alive, grid):  # nothing read from a dead rank
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            peer = data_half(data, deltas, r, parity, half)
            acc += tl.load(peer + row * H + cols, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        h = round_to(acc, DT, HW)
        if HAS_RES:
            h = round_to(h + tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32), DT, HW)
        tl.store(ro_ptr + row * H + cols, h.to(DT), mask=mask)
        normalize_row(h, w_ptr, cols, mask, y_ptr + row * H, s_ptr + row, H, eps, QUANT, DT, HW)


def one_shot_all_reduce(
    x: torch.Tensor, peers: Peers, out: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """The sum over the ranks of their x (contiguous, the peers' dtype, at most a data half) into
    `out` (a new tensor by default; x itself is allowed). Every rank calls it with the same shape."""
    check_model_dtype("x", x)
    peers.check_message(x)
    out = torch.empty_like(x) if out is None else out
    n = x.numel()
    if n:
        _one_shot_kernel[(grid_of(triton.cdiv(n, BLOCK)),)](
            x, out, n, peers.data, peers.deltas, peers.half, peers.bases, peers.counters, peers.timeout_ns,
            peers.abort.data_ptr(), RANK=peers.rank, WORLD=peers.world, BLOCK=BLOCK, HW=use_hw_casts(x), num_warps=8,
            **launch_options(pdl),
        )  # fmt: skip
    return out


def fits_fused(x: torch.Tensor, peers: Peers) -> bool:
    """Whether the fused kernel takes x [T, H]: unit column stride, a row in one register tile, the
    message in a data half."""
    return x.dim() == 2 and x.stride(1) == 1 and x.shape[1] <= MAX_BLOCK and peers.fits(x)


def fused_outputs(
    x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, quant: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(y, ys or None, residual_out) of a fused all-reduce + AddRMSNorm[Quant] of x [T, H] (this
    kernel's and ll_allreduce's), after checking residual and w against x."""
    tokens, hidden = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype} with unit column stride")
    if w.shape != (hidden,) or w.dtype != x.dtype:
        raise ValueError(f"w must be [{hidden}] {x.dtype}, got {tuple(w.shape)} {w.dtype}")
    residual_out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if not quant:
        return torch.empty(tokens, hidden, dtype=x.dtype, device=x.device), None, residual_out
    y = torch.empty(tokens, hidden, dtype=FP8, device=x.device)
    return y, torch.empty(tokens, 1, dtype=torch.float32, device=x.device), residual_out


def all_reduce_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    quant: bool,
    peers: Peers,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, ...]:
    """AddRMSNorm[Quant] (add_rmsnorm_quant.py) of the sum over the ranks of their x [T, H]:
    quant -> (yq fp8 [T, H], ys fp32 [T, 1], residual_out [T, H]); else (y [T, H], residual_out)."""
    check_model_dtype("x", x)
    if not fits_fused(x, peers):
        raise ValueError(
            f"x {tuple(x.shape)} does not fit the fused kernel (rows <= {MAX_BLOCK}, <= {peers.half} elements)"
        )
    tokens, hidden = x.shape
    y, ys, residual_out = fused_outputs(x, residual, w, quant)
    if tokens:
        block, _, num_warps = row_config(hidden)
        has_res = residual is not None
        _fused_kernel[(grid_of(tokens),)](
            x, residual if has_res else x, w.contiguous(), residual_out,
            y.view(torch.uint8) if quant else y, ys if quant else residual_out,
            tokens, hidden, x.stride(0), residual.stride(0) if has_res else 0, float(eps),
            peers.data, peers.deltas, peers.half, peers.bases, peers.counters, peers.timeout_ns,
            peers.abort.data_ptr(), RANK=peers.rank, WORLD=peers.world, HAS_RES=has_res, QUANT=quant, BLOCK=block, HW=use_hw_casts(x),
            num_warps=num_warps,
            **launch_options(pdl),
        )  # fmt: skip
    return (y, ys, residual_out) if quant else (y, residual_out)
