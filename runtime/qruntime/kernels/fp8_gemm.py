"""PTPC FP8 GEMM: y = (xq · wᵀ accumulated in fp32) * xs * wsᵀ (the `PTPCLinear` op).

xq [M,K] fp8 e4m3 with per-token scales xs [M,1] fp32; w [N,K] fp8 e4m3 (row-major, K contiguous)
with per-output-channel scales ws [N,1]. The reference is qruntime.ops.functional.ptpc_linear.

One program computes a [BLOCK_M, BLOCK_N] output tile over one K range: A tiles [BLOCK_M, BLOCK_K]
are read row-major, B tiles [BLOCK_K, BLOCK_N] through a transposed view of w (K-major, the operand
order Hopper's fp8 wgmma wants), and tl.dot(fp8, fp8) accumulates in fp32 (the interpreter runs the
fp8 dot too, exactly). Hopper's wgmma (tiles of >= 64 rows) adds fp8 products at reduced precision,
and Triton's default there never promotes (H100, K=4096: ||err||/||ref|| 1.4e-3); so the tensor-core
partial is added into the fp32 accumulator every 128 of K (max_num_imprecise_acc, as DeepGEMM does):
1.3e-4, the largest error under half a bf16 ulp of the largest output and within one ulp of
torch._scaled_mm. Promoting every 32 of K (4.7e-5) cost up to 2x at large M. The 16-row decode
tiles run on mma.sync, exact fp32 (~2e-7). Both scales factor out of the K sum, so they are applied
once, to the full sum.

Split-K (decode: a few tokens, streaming the weight is the whole cost, and at N=4096 the N tiles
alone leave SMs idle): program (tile, s) sums K range s into an fp32 workspace [split_k, M, N];
_splitk_reduce_kernel then adds the partials in split order (deterministic), applies the scales and
casts. Measured on an H100 at M <= 16 in CUDA graphs against (a) fp32 atomic_add into a zeroed
[M, N] workspace + a scale/cast kernel and (b) a single kernel whose last-arriving program per tile
(an atomic counter) reduces: the workspace + reduce kernel was as fast or faster (by 0-5%); (a)
needs a memset and a third launch, (b) a memset of its counters plus a serial tail in the GEMM; at
M <= 16 the [S, M, N] partials are a few hundred KB and stay in L2.

One token (M = 1, batch-1 decode) runs by default as a GEMV (GemmConfig block_m 1,
_ptpc_fp8_gemv_kernel): a program takes BLOCK_N weight rows and all of K, its K steps unrolled so
every load is in flight at once, products of the fp8 codes on the CUDA cores in fp32 (exact; the
sum in another order than the tensor cores'), no split-K and so no partials. With PDL a program
of a small weight (a rank's slice at tp > 1) first asks L2 for all of its rows (the weights do not
depend on the previous kernel), so the weight stream starts during that kernel (_gemv_prefetch).
Measured with bench/gemv_bench.py on an H100 (f81ec31, CUDA graphs, weights rotated past L2) it
beats the tiles with their split-K reduction at most attention shapes (qwen3-30b-a3b tp 4 qkv 2.2
vs 4.1 µs, o 2.2 vs 2.8; qwen3-8b o 7.8 vs 9.1), but not the tiles whose partials the next kernel
adds (folded: qwen3-8b qkv 9.2 vs 10.8, qwen3-30b-a3b o 4.0 vs 5.4): the tuner times all three.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from qruntime.kernels.deferred_sum import deferred_value
from qruntime.kernels.dynamic_quant import (
    FP8_FORMATS,
    MAX_BLOCK,
    check_model_dtype,
    fp8_e4m3_code,
    fp8_scale,
    fp8_values,
    quant_scale,
    round_to,
    use_hw_casts,
)
from qruntime.kernels.pdl import launch_options, prefetch_l2, wait_for_inputs

_SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NUM_SMS_H100 = 132  # the heuristic's target; a tuner replaces it per device
# K elements the tensor cores accumulate (at reduced precision on Hopper) before the fp32 add
_ACC_PROMOTE_K = 128


@dataclass(frozen=True)
class GemmConfig:
    """Launch configuration of ptpc_fp8_gemm (the JSON record of the tuner)."""

    block_m: int  # 1: the one-token GEMV, else the tile height
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block_m == 1:  # the one-token GEMV (_ptpc_fp8_gemv_kernel): BLOCK_N weight rows, all of K
            if not 1 <= self.block_n <= 256 or self.block_n & (self.block_n - 1):
                raise ValueError(
                    f"{type(self).__name__}.block_n of a GEMV must be a power of two in 1..256, got {self.block_n}"
                )
            if self.block_k < 16 or self.block_k & (self.block_k - 1) or self.split_k != 1:
                raise ValueError(
                    f"{type(self).__name__}: a GEMV takes block_k a power of two >= 16 and split_k 1, "
                    f"got {self.block_k} and {self.split_k}"
                )
        for name in ("block_m", "block_n", "block_k") if self.block_m != 1 else ():
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{type(self).__name__}.{name} must be a power of two >= 16, got {v}")
        if self.split_k < 1:
            raise ValueError(f"{type(self).__name__}.split_k must be >= 1, got {self.split_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{type(self).__name__}.num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"{type(self).__name__}.num_stages must be >= 1, got {self.num_stages}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GemmConfig:
        return cls(**{k: int(d[k]) for k in ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")})


MAX_GEMV_UNROLL = 32  # K steps a GEMV program unrolls at most (block_k is raised to keep within it)
MAX_GEMV_PREFETCH = 16384  # bytes of each weight row a GEMV program asks L2 for before its PDL wait
GEMV_PREFETCH_ALL = 4 << 20  # weights up to this many bytes: a GEMV prefetches its whole rows


def _gemv_prefetch(n: int, k: int, prefetch_k: int) -> int:
    """Bytes of each weight row a GEMV program asks L2 for before its PDL wait: all of them for a
    weight of at most GEMV_PREFETCH_ALL bytes, else prefetch_k (the tiled GEMM's). Measured on an
    H100 (bench/gemv_bench.py, f81ec31: full rows against no PDL at all): qwen3-30b-a3b tp 4's qkv
    and o (2-3 MB) 3.3 -> 2.2 and 2.9 -> 2.2 µs, but qwen3-8b's qkv and down (25 and 50 MB, half
    of L2 and more, evicted before use) 10.8 -> 12.3 and 20.9 -> 23.2 µs."""
    if prefetch_k == 0:
        return 0
    if n * k <= GEMV_PREFETCH_ALL:
        return min(MAX_GEMV_PREFETCH, max(128, triton.next_power_of_2(k)))
    return prefetch_k


def gemv_steps(k: int, block_k: int) -> tuple[int, int]:
    """(block_k, unrolled steps) of a GEMV over K: block_k no wider than K needs, raised until the
    steps fit MAX_GEMV_UNROLL."""
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    while triton.cdiv(k, block_k) > MAX_GEMV_UNROLL:
        block_k *= 2
    return block_k, triton.cdiv(k, block_k)


def split_for(tiles: int, k: int, block_k: int, target: int) -> int:
    """Smallest power-of-two split that gives >= target programs, keeping >= 4 K tiles per split."""
    split = 1
    while tiles * split < target and k // (block_k * split * 2) >= 4:
        split *= 2
    return split


def _waves(m: int, n: int, block_m: int, block_n: int) -> int:
    return triton.cdiv(triton.cdiv(m, block_m) * triton.cdiv(n, block_n), _NUM_SMS_H100)


def default_gemv(n: int, k: int) -> GemmConfig:
    """The one-token GEMV's config: 4 rows a program (the fastest on an H200 at every qwen3-8b /
    30b-a3b attention shape measured, 2-8 warps within 0.3 µs), 4 warps, 512-wide K steps."""
    return GemmConfig(1, 4, 512, 1, 4, 1)


def _tensor_core_decode(n: int, k: int) -> GemmConfig:
    bn, bk = 32, 256
    return GemmConfig(16, bn, bk, split_for(triton.cdiv(n, bn), k, bk, _NUM_SMS_H100), 4, 4)


def default_config(m: int, n: int, k: int) -> GemmConfig:
    """Heuristic config per token-count bucket (H100-sized: 132 SMs; measured choices, see the bench).

    - m == 1: the GEMV (default_gemv).
    - m <= 16 (decode): streaming the N*K weight bytes is the whole cost. 16x32x256 tiles (mma.sync
      at BLOCK_M 16), 4 stages in flight, and split-K until the programs cover every SM (o and down
      at N=4096: 128 N tiles -> split 2; qkv and gate_up have enough N tiles).
    - m <= 64: 64x64x128, split-K only when the tiles fill less than half of the SMs.
    - m <= 512: 64x128x128, 4 warps.
    - larger: 256x128x128 with 8 warps, or 64x128x128 where its finer tiles waste fewer SM-waves."""
    if m == 1:
        return default_gemv(n, k)
    if m <= 16:
        return _tensor_core_decode(n, k)
    if m <= 64:
        bn, bk = 64, 128
        tiles = triton.cdiv(m, 64) * triton.cdiv(n, bn)
        return GemmConfig(64, bn, bk, split_for(tiles, k, bk, _NUM_SMS_H100 // 2 + 1), 4, 4)
    # a 256x128 tile is 4 of 64x128, and (measured) ~1.25x more efficient per FLOP than 64x128
    if m <= 512 or 5 * _waves(m, n, 64, 128) < 16 * _waves(m, n, 256, 128):
        return GemmConfig(64, 128, 128, 1, 4, 4)
    return GemmConfig(256, 128, 128, 1, 8, 3)


def sweep_configs(m: int, n: int, k: int) -> list[GemmConfig]:
    """A small candidate list for the tuner to time at (m, n, k); default_config comes first."""
    cands: list[GemmConfig] = [default_config(m, n, k)]
    if m == 1:  # the GEMV's, then the 16-row tiles' below
        for bn, bk, warps in ((4, 1024, 2), (4, 1024, 4), (8, 512, 4)):
            cands.append(GemmConfig(1, bn, bk, 1, warps, 1))
    if m <= 16:
        for bn, bk, stages in ((16, 256, 4), (32, 256, 4), (32, 256, 6), (32, 128, 8), (64, 256, 4), (64, 128, 6)):
            tiles = triton.cdiv(n, bn)
            for target in (_NUM_SMS_H100, 2 * _NUM_SMS_H100):
                cands.append(GemmConfig(16, bn, bk, split_for(tiles, k, bk, target), 4, stages))
    elif m <= 512:
        bm = 32 if m <= 32 else 64
        for bn, bk, warps, stages in ((64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 8, 3)):
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            cands.append(GemmConfig(bm, bn, bk, 1, warps, stages))
            cands.append(GemmConfig(bm, bn, bk, split_for(tiles, k, bk, _NUM_SMS_H100), warps, stages))
        cands.append(GemmConfig(128, 128, 128, 1, 8, 3))
    else:
        for bm, bn, bk, warps, stages in (
            (256, 128, 128, 8, 3),
            (128, 128, 128, 8, 3),
            (128, 128, 128, 4, 4),
            (64, 128, 128, 4, 4),
            (128, 128, 64, 4, 4),
        ):
            cands.append(GemmConfig(bm, bn, bk, 1, warps, stages))
    return list(dict.fromkeys(cands))


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` in grouped order: GROUP_M row tiles run one after
    another over each column tile, so they share the weight tiles they read while those sit in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % group_size) % group_m, (pid % group_size) // group_m


@triton.jit
def _ptpc_fp8_gemm_kernel(
    a_ptr,  # [M, K] fp8
    as_ptr,  # [M, 1] fp32
    b_ptr,  # [N, K] fp8
    bs_ptr,  # [N, 1]
    c_ptr,  # [M, N] out dtype
    part_ptr,  # [SPLIT_K, M, N] fp32 (split-K only)
    M,
    N,
    K,
    stride_am,
    stride_as,
    stride_bn,
    stride_bs,
    stride_cm,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    ACC_PROMOTE_K: tl.constexpr,  # <= BLOCK_K
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    PREFETCH_K: tl.constexpr,  # with PDL: bytes of each of its weight rows a program asks L2 for before the wait
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past M are masked (never read: at decode, M < BLOCK_M rows aliasing one row would make every
    # program hit the same L2 lines); columns past N read column 0 instead (in bounds, never stored)
    mask_m = (offs_m < M)[:, None]  # [BLOCK_M, 1]
    rn = tl.where(offs_n < N, offs_n, 0)

    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    if PDL and PREFETCH_K > 0:  # the weights do not depend on the previous kernel: start reading them
        lines = k_start + tl.arange(0, PREFETCH_K // 128) * 128  # 128-byte L2 lines
        prefetch_l2(b_ptr + rn[:, None] * stride_bn + tl.minimum(lines, k_end - 1)[None, :])
    wait_for_inputs(PDL)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + (k_start + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + rn[None, :] * stride_bn + (k_start + offs_k)[:, None]  # [BLOCK_K, BLOCK_N], K-major
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m, other=0.0)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=mask_m & ((k + offs_k)[None, :] < K), other=0.0)
            b = tl.load(b_ptrs, mask=(k + offs_k)[:, None] < K, other=0.0)
        # fp8 x fp8 -> fp32; on Hopper, wgmma accumulates fp8 products in reduced precision, so the
        # partial sum is added into the fp32 accumulator every ACC_PROMOTE_K elements of K
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=ACC_PROMOTE_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    mask_c = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K > 1:  # fp32 partial of K range pid_k; _splitk_reduce_kernel sums and scales
        tl.store(part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask_c)
    else:
        xs = tl.load(as_ptr + offs_m * stride_as, mask=offs_m < M, other=0.0)  # [BLOCK_M] fp32
        ws = tl.load(bs_ptr + rn * stride_bs).to(tl.float32)  # [BLOCK_N]
        y = acc * xs[:, None] * ws[None, :]
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], y.to(c_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _ptpc_fp8_gemv_kernel(
    a_ptr,  # [1, K] fp8; QUANT: [1, K] model dtype, quantized here
    as_ptr,  # [1, 1] fp32 (not read with QUANT)
    b_ptr,  # [N, K] fp8
    bs_ptr,  # [N, 1]
    c_ptr,  # [1, N] out dtype
    N,
    K,
    stride_bn,
    stride_bs,
    NUM_K: tl.constexpr,  # K steps, unrolled
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    PREFETCH_K: tl.constexpr,  # with PDL: bytes of each of its weight rows a program asks L2 for before the wait
    QUANT: tl.constexpr = False,  # a_ptr is the unquantized row: dynamic_quant's codes and scale made here
    BLOCK_X: tl.constexpr = 16,  # QUANT: the row's tile for its max |x| (NUM_X of them)
    NUM_X: tl.constexpr = 1,
    HW: tl.constexpr = False,  # QUANT: hardware casts (dynamic_quant.use_hw_casts)
    FNUZ: tl.constexpr = False,  # QUANT: the codes made as e4m3fnuz (the weights' format), the scale doubled
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.where(offs_n < N, offs_n, 0)  # rows past N read row 0 (never stored)
    offs_k = tl.arange(0, BLOCK_K)
    b_ptrs = b_ptr + rn[:, None].to(tl.int64) * stride_bn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    if PDL and PREFETCH_K > 0:  # the weights do not depend on the previous kernel: start reading them
        lines = tl.arange(0, PREFETCH_K // 128) * 128  # 128-byte L2 lines
        prefetch_l2(b_ptr + rn[:, None].to(tl.int64) * stride_bn + tl.minimum(lines, K - 1)[None, :])
    wait_for_inputs(PDL)
    if QUANT:  # every program takes the row's max |x| itself (the row is a few KB, from L2)
        cols = tl.arange(0, BLOCK_X)
        amax = tl.zeros((BLOCK_X,), dtype=tl.float32)
        for chunk in tl.static_range(NUM_X):
            x = tl.load(a_ptr + chunk * BLOCK_X + cols, mask=chunk * BLOCK_X + cols < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = quant_scale(tl.max(amax, axis=0))
        inv_scale = tl.math.div_rn(1.0, scale)
    else:
        scale = tl.load(as_ptr)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for step in tl.static_range(NUM_K):
        k = step * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptr + k + offs_k).to(tl.float32)
            b = tl.load(b_ptrs + k).to(tl.float32)
        else:
            a = tl.load(a_ptr + k + offs_k, mask=k + offs_k < K, other=0.0).to(tl.float32)
            b = tl.load(b_ptrs + k, mask=(k + offs_k < K)[None, :], other=0.0).to(tl.float32)
        if QUANT:
            a = fp8_values(fp8_e4m3_code(a, scale, inv_scale, HW, FNUZ), FNUZ).to(tl.float32)
        acc += b * a[None, :]  # fp8 codes widened: exact products, fp32 sums
    if QUANT:
        scale = fp8_scale(scale, FNUZ)
    y = tl.sum(acc, axis=1) * scale * tl.load(bs_ptr + rn * stride_bs).to(tl.float32)
    tl.store(c_ptr + offs_n, y.to(c_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _splitk_reduce_kernel(
    part_ptr,  # [SPLIT_K, M, N] fp32
    as_ptr,  # [M, 1] fp32
    bs_ptr,  # [N, 1]
    c_ptr,  # [M, N] out dtype, contiguous
    M,
    N,
    stride_as,
    stride_bs,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HW: tl.constexpr,  # hardware rounding (the interpreter's fp32 -> bf16 cast truncates)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat index into [M, N]
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):  # split order: the result does not depend on scheduling
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    row = offs // N
    col = offs % N
    xs = tl.load(as_ptr + row * stride_as, mask=mask, other=0.0)
    ws = tl.load(bs_ptr + col * stride_bs, mask=mask, other=0.0).to(tl.float32)
    y = round_to(acc * xs * ws, c_ptr.dtype.element_ty, HW)  # exact in the output dtype
    tl.store(c_ptr + offs, y.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def splitk_value(
    part_ptr, as_ptr, bs_ptr, row, cols, mask, M, N, stride_as, stride_bs,
    SPLIT: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """Elements (row, cols) of a split-K GEMM's output read from its fp32 partials [SPLIT, M, N]: the
    sum in split order from zero, times xs[row] then ws[cols], rounded to DTYPE; the bits
    _splitk_reduce_kernel stores, as fp32 (0 where masked). cols may have any shape."""
    return deferred_value(
        part_ptr, as_ptr, bs_ptr, row, cols, mask, M * N, N, stride_as, stride_bs, SPLIT, True, DTYPE, HW
    )


@dataclass(frozen=True)
class SplitKPartials:
    """A split-K PTPC GEMM's output before its reduction launch: partials [S, M, N] fp32 (the sum
    over K range s), the scales xs [M, 1] fp32 and ws [N, 1], and the output dtype. The row kernels
    that read a linear's output (add_rmsnorm_quant, silu_mul_quant, qknorm_rope_kvwrite) take it in
    place of the [M, N] tensor and compute each element as the reduction would (splitk_value), so a
    decode step saves that launch; `reduce()` runs it for any other reader."""

    partials: torch.Tensor
    xs: torch.Tensor
    ws: torch.Tensor
    dtype: torch.dtype
    pdl: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.partials.shape[1], self.partials.shape[2])

    @property
    def device(self) -> torch.device:
        return self.partials.device

    @property
    def split(self) -> int:
        return self.partials.shape[0]

    slices = split
    scaled = True

    def kernel_args(self) -> tuple:
        """(partials, xs, ws, M, stride of xs, stride of ws): what a reading kernel passes to splitk_value."""
        return (self.partials, self.xs, self.ws, self.shape[0], self.xs.stride(0), self.ws.stride(0))

    def sum_args(self) -> tuple:
        """(base, xs, ws, slice stride, row stride, stride of xs, stride of ws): deferred_value's."""
        m, n = self.shape
        return (self.partials, self.xs, self.ws, m * n, n, self.xs.stride(0), self.ws.stride(0))

    def reduce(self) -> torch.Tensor:
        """The [M, N] output (the reduction launch)."""
        m, n = self.shape
        out = torch.empty((m, n), dtype=self.dtype, device=self.device)
        if m * n:
            _reduce(self.partials, self.xs, self.ws, out, self.pdl)
        return out


def check_partials(x: SplitKPartials, like: torch.Tensor | None, w: torch.Tensor) -> None:
    """ValueError unless x's output would be a [T, N] tensor of w's dtype and device, shaped as `like`
    (when given): what a kernel reading it in place of that tensor needs."""
    if (
        x.dtype != w.dtype
        or x.device != w.device
        or (like is not None and (tuple(like.shape), like.dtype) != (x.shape, x.dtype))
    ):
        raise ValueError(
            f"deferred output (split-K partials / MoE pair rows) of {x.shape} {x.dtype} on {x.device} does not match "
            f"{'' if like is None else f'{tuple(like.shape)} '}{w.dtype} on {w.device}"
        )


def _reduce(part: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor, out: torch.Tensor, pdl: bool) -> None:
    (split, m, n), block = part.shape, 1024
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        part,
        xs,
        ws,
        out,
        m,
        n,
        xs.stride(0),
        ws.stride(0),
        SPLIT_K=split,
        BLOCK=block,
        HW=use_hw_casts(out),
        num_warps=4,
        **launch_options(pdl),
    )


def _gemv(a, xs, w, ws, out, cfg: GemmConfig, pdl: bool, prefetch_k: int, quant: bool = False) -> None:
    """Launch the GEMV of one token: a [1, K] fp8 codes with scale xs, or (quant) the model-dtype row."""
    n, k = w.shape
    block_k, steps = gemv_steps(k, cfg.block_k)
    block_x = min(triton.next_power_of_2(k), MAX_BLOCK)
    _ptpc_fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        a, xs, w, ws, out, n, k, w.stride(0), ws.stride(0),
        NUM_K=steps, BLOCK_N=cfg.block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=cfg.num_warps,
        PREFETCH_K=_gemv_prefetch(n, k, prefetch_k) if pdl else 0,
        QUANT=quant, BLOCK_X=block_x, NUM_X=triton.cdiv(k, block_x), HW=use_hw_casts(a),
        FNUZ=w.dtype == torch.float8_e4m3fnuz,
        **launch_options(pdl),
    )  # fmt: skip


def ptpc_fp8_gemv_quant(
    x: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    out_dtype: torch.dtype,
    config: GemmConfig,
    *,
    pdl: bool = False,
    prefetch_k: int = 0,
) -> torch.Tensor:
    """ptpc_fp8_gemm(*dynamic_quant(x), w, ws, ...) of one token in one launch: x [1, K] bf16 | fp16 |
    fp32, config a GEMV's (block_m 1). Each program takes the row's max |x| and quantizes the row as
    it reads it (dynamic_quant's scale and codes, bit for bit), so the result is the two launches'
    bit for bit. w float8_e4m3fnuz (amd-gfx942, its scales doubled): the codes made as e4m3fnuz
    with the scale doubled, dynamic_quant(x, fp8=float8_e4m3fnuz)'s. Raises ValueError on a shape,
    dtype or config mismatch."""
    check_model_dtype("x", x)
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        raise ValueError(f"x must be one token's row [1, K] with unit column stride, got {tuple(x.shape)}")
    if config.block_m != 1:
        raise ValueError(f"ptpc_fp8_gemv_quant runs a GEMV config (block_m 1), got block_m {config.block_m}")
    if w.dtype not in FP8_FORMATS or w.dim() != 2 or w.shape[1] != x.shape[1] or w.stride(1) != 1:
        raise ValueError(
            f"w must be float8_e4m3fn or float8_e4m3fnuz [N, {x.shape[1]}] with contiguous rows, got {w.dtype} "
            f"{tuple(w.shape)}"
        )
    if ws.dtype not in _SCALE_DTYPES or tuple(ws.shape) != (w.shape[0], 1):
        raise ValueError(f"ws must be bf16/fp16/fp32 [N,1] = [{w.shape[0]},1], got {ws.dtype} {tuple(ws.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if len({t.device for t in (x, w, ws)}) != 1:
        raise ValueError(f"all inputs must be on one device, got {[str(t.device) for t in (x, w, ws)]}")
    out = torch.empty((1, w.shape[0]), dtype=out_dtype, device=x.device)
    if w.shape[0] and x.shape[1]:
        _gemv(x, x, w, ws, out, config, pdl, prefetch_k, quant=True)  # (no scale to pass: x stands in)
    elif w.shape[0]:
        out.zero_()
    return out


def _check(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype) -> None:
    if xq.dtype not in FP8_FORMATS or w.dtype != xq.dtype:
        raise ValueError(
            f"xq and w must be both float8_e4m3fn or both float8_e4m3fnuz (the target's), got {xq.dtype} and {w.dtype}"
        )
    if xq.dim() != 2 or w.dim() != 2:
        raise ValueError(f"xq [M,K] and w [N,K] must be 2-D, got shapes {tuple(xq.shape)} and {tuple(w.shape)}")
    (m, k), (n, kw) = xq.shape, w.shape
    if k != kw:
        raise ValueError(f"xq [M,K] and w [N,K] disagree on K: {tuple(xq.shape)} vs {tuple(w.shape)}")
    if xs.dtype != torch.float32 or tuple(xs.shape) != (m, 1):
        raise ValueError(f"xs must be float32 [M,1] = [{m},1], got {xs.dtype} {tuple(xs.shape)}")
    if ws.dtype not in _SCALE_DTYPES or tuple(ws.shape) != (n, 1):
        raise ValueError(f"ws must be bf16/fp16/fp32 [N,1] = [{n},1], got {ws.dtype} {tuple(ws.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if k > 0 and (xq.stride(1) != 1 or w.stride(1) != 1):
        raise ValueError(
            f"xq and w need contiguous rows (stride 1 along K), got strides {xq.stride()} and {w.stride()}"
        )
    if len({t.device for t in (xq, xs, w, ws)}) != 1:
        raise ValueError(f"all inputs must be on one device, got {[str(t.device) for t in (xq, xs, w, ws)]}")


def ptpc_fp8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: GemmConfig | None = None,
    *,
    pdl: bool = False,
    prefetch_k: int = 0,
    defer_reduce: bool = False,
) -> torch.Tensor | SplitKPartials:
    """PTPC FP8 linear: [M,K] x [N,K] -> [M,N], y = (xq · wᵀ in fp32) * xs * wsᵀ, cast to out_dtype.

    xq: [M,K] float8_e4m3fn, rows contiguous; xs: [M,1] float32 per-token scales;
    w: [N,K] float8_e4m3fn, rows contiguous; ws: [N,1] bf16/fp16/fp32 per-channel scales.
    Both may be float8_e4m3fnuz instead (amd-gfx942: e4m3fn's codes, the scales doubled), the
    kernels then read them as such (Triton's fp8e4b8, from the tensors' dtype): the same product.
    config: tile sizes, split-K and launch parameters; default_config(M, N, K) when None.
    pdl: programmatic dependent launch (kernels/pdl.py); with it, each program first asks L2 for
    the first `prefetch_k` bytes (a multiple of 128; 0: none) of its weight rows, before the wait
    (a GEMV program of a weight of at most GEMV_PREFETCH_ALL bytes, with prefetch_k > 0, for all of
    its rows up to MAX_GEMV_PREFETCH bytes).
    defer_reduce: when the config splits K, return the SplitKPartials without the reduction launch.
    Raises ValueError on a dtype, shape, stride or device mismatch.
    """
    _check(xq, xs, w, ws, out_dtype)
    if prefetch_k < 0 or prefetch_k % 128 or prefetch_k & (prefetch_k - 1):
        raise ValueError(f"prefetch_k must be 0 or a power of two multiple of 128 bytes, got {prefetch_k}")
    (m, k), n = xq.shape, w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or default_config(m, n, k)
    if cfg.block_m == 1 and m != 1:  # a GEMV config stands for the tiled default above one token
        cfg = default_config(m, n, k)
    if cfg.block_m == 1:
        _gemv(xq, xs, w, ws, out, cfg, pdl, prefetch_k)
        return out
    k_tiles = triton.cdiv(k, cfg.block_k)
    tiles_per_split = triton.cdiv(k_tiles, min(cfg.split_k, k_tiles))
    split = triton.cdiv(k_tiles, tiles_per_split)  # no empty split
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    # [S, M, N] fp32 partials (split-K only)
    part = torch.empty((split, m, n), dtype=torch.float32, device=xq.device) if split > 1 else out
    _ptpc_fp8_gemm_kernel[(tiles, split)](
        xq,
        xs,
        w,
        ws,
        out,
        part,
        m,
        n,
        k,
        xq.stride(0),
        xs.stride(0),
        w.stride(0),
        ws.stride(0),
        out.stride(0),
        tiles_per_split * cfg.block_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        GROUP_M=8,
        EVEN_K=k % cfg.block_k == 0,
        ACC_PROMOTE_K=min(_ACC_PROMOTE_K, cfg.block_k),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        PREFETCH_K=prefetch_k if pdl else 0,
        **launch_options(pdl),
    )
    if split > 1:
        if defer_reduce:
            return SplitKPartials(part, xs, ws, out_dtype, pdl)
        _reduce(part, xs, ws, out, pdl)
    return out
