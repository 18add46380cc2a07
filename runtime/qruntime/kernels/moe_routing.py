"""MoE routing fused with the per-token FP8 quantization of the experts' input (fused MoE, step 1).

Reference: qruntime.ops.functional.moe_routing(logits, k, norm) and dynamic_quant(x, 0). One
program per token:
- routing: p = softmax(logits) in fp32 (exp(l - max) / sum, IEEE division), then k times the
  largest remaining p (ties: the lowest expert id, as torch.topk on CUDA gives), optionally divided
  by their sum (added in slot order). Weights stay fp32 here; the down projection rounds them to
  the model dtype where the reference multiplies by them. Triton's exp on a GPU may differ from
  torch's in the last bit, so weights agree to fp32 rounding and ids but for exact near-ties.
- quantization of x's row: bit for bit dynamic_quant (the same helpers as kernels/dynamic_quant.py:
  one register tile when H fits MAX_BLOCK, else two passes over chunks).

A step of one token (batch-1 decode) needs no grouping launch: its k pairs go to k distinct
experts, so `moe_route_quant_one` also writes the grouped pair list of moe_align.py in the same
program, one block per slot (block s: expert topk_ids[0, s], pair s in its first row, the sentinel
k in the others) — moe_align's list up to the order of the blocks, which the GEMMs' results do not
depend on (moe_gemm.py) — saving the fused MoE a launch per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qruntime.kernels.dynamic_quant import (
    FP8,
    MAX_BLOCK,
    MIN_SCALE,
    check_model_dtype,
    fnuz_format,
    fp8_e4m3_code,
    fp8_scale,
    quant_scale,
    quantize_row,
    round_to,
    row_config,
    rows_of,
    use_hw_casts,
)
from qruntime.kernels.pdl import launch_options, wait_for_inputs
from qruntime.kernels.row_rmsnorm import normed_value, row_rstd

MAX_EXPERTS = 4096  # the router row is one register tile
MAX_ROUTER_TILE = 4096  # router weights a program of moe_router_one holds per step of its H loop


@triton.jit
def _moe_route_quant_kernel(
    logits_ptr,  # [T, E] any float dtype, unit column stride
    x_ptr,  # [T, H] model dtype, unit column stride
    weights_ptr,  # [T, TOP_K] fp32
    ids_ptr,  # [T, TOP_K] int32
    xq_ptr,  # [T, H] uint8 view of the fp8 output, contiguous
    xs_ptr,  # [T] fp32
    E,
    H,
    stride_l,
    stride_x,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,  # renormalise the k weights to sum 1
    BLOCK_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    HW: tl.constexpr,
    sorted_ptr=None,  # LAYOUT: [TOP_K * BLOCK_M] int32, moe_align's grouped pair list
    block_expert_ptr=None,  # LAYOUT: [TOP_K] int32
    num_padded_ptr=None,  # LAYOUT: [1] int32
    amax_ptr=None,  # LAYOUT: [TOP_K * BLOCK_M] fp32, zeroed
    LAYOUT: tl.constexpr = False,  # one token: also lay out its pairs, a block per slot
    BLOCK_M: tl.constexpr = 16,
    BLOCK_PAIRS: tl.constexpr = 16,  # next power of two of TOP_K * BLOCK_M
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
    FNUZ: tl.constexpr = False,  # xq in e4m3fnuz (amd-gfx942), xs doubled
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)

    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + row * stride_l + experts, mask=experts < E, other=float("-inf")).to(tl.float32)
    _route(logits, row, E, weights_ptr, ids_ptr, TOP_K, NORM, BLOCK_E, BLOCK_TOPK)
    if LAYOUT:  # row 0 is the only token
        _lay_out_one(
            ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, amax_ptr, TOP_K, BLOCK_TOPK, BLOCK_M, BLOCK_PAIRS
        )
    # ---- per-token FP8 quantization of x (as _dynamic_quant_kernel)
    scale = quantize_row(x_ptr + row * stride_x, xq_ptr + row * H, H, BLOCK, NUM_CHUNKS, HW, FNUZ)
    tl.store(xs_ptr + row, fp8_scale(scale, FNUZ))


@triton.jit
def _route(
    logits,
    row,
    E,
    weights_ptr,
    ids_ptr,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
):
    """Routing of one token from its fp32 logits [BLOCK_E] (-inf past E): fp32 softmax, top-k by
    repeated arg-max, optional renormalisation; stores its k weights and expert ids."""
    experts = tl.arange(0, BLOCK_E)
    num = tl.exp(logits - tl.max(logits, axis=0))  # 0 past E
    probs = tl.math.div_rn(num, tl.sum(num, axis=0))
    cand = tl.where(experts < E, probs, -1.0)  # -1: below every probability, never picked
    slots = tl.arange(0, BLOCK_TOPK)
    top_w = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_TOPK], dtype=tl.int32)
    total = 0.0
    for s in tl.static_range(TOP_K):
        best, best_i = tl.max(cand, axis=0, return_indices=True, return_indices_tie_break_left=True)
        top_w = tl.where(slots == s, best, top_w)
        top_i = tl.where(slots == s, best_i, top_i)
        total += best
        cand = tl.where(experts == best_i, -1.0, cand)
    if NORM:
        top_w = tl.math.div_rn(top_w, tl.zeros_like(top_w) + total)
    tl.store(weights_ptr + row * TOP_K + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, top_i, mask=slots < TOP_K)


@triton.jit
def _lay_out_one(
    ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, amax_ptr,
    TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
):  # fmt: skip
    """The pair list of a single token: pair s = slot s in the first row of block s (expert ids[s])."""
    tl.debug_barrier()  # the ids just stored, read back by every thread
    slots = tl.arange(0, BLOCK_TOPK)
    tl.store(block_expert_ptr + slots, tl.load(ids_ptr + slots, mask=slots < TOP_K), mask=slots < TOP_K)
    pos = tl.arange(0, BLOCK_PAIRS)
    used = pos < TOP_K * BLOCK_M
    tl.store(sorted_ptr + pos, tl.where(pos % BLOCK_M == 0, pos // BLOCK_M, TOP_K).to(tl.int32), mask=used)
    tl.store(amax_ptr + pos, tl.zeros([BLOCK_PAIRS], dtype=tl.float32), mask=used)
    tl.store(num_padded_ptr, TOP_K * BLOCK_M)


@triton.jit
def _router_one_kernel(
    x_ptr,  # [1, H] model dtype
    w_ptr,  # [E, H] router rows, model dtype, unit column stride
    logits_ptr,  # [E] fp32 scratch: the logits, rounded to the model dtype
    counter_ptr,  # [1] int32, zero between launches (the last program puts it back)
    weights_ptr,
    ids_ptr,
    xq_ptr,
    xs_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    amax_ptr,
    E,
    H,
    stride_w,
    r_ptr,  # RMS: the residual row [1, H]
    nw_ptr,  # RMS: the norm weight [H]
    ro_ptr,  # RMS: residual_out [1, H], written by program 0
    eps,  # RMS
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    HW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
    EXPERTS: tl.constexpr,  # router rows per program
    BLOCK_H: tl.constexpr,
    SLICE: tl.constexpr,  # columns of x each program quantizes
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    FNUZ: tl.constexpr = False,  # xq in e4m3fnuz (amd-gfx942), xs doubled
    RMS: tl.constexpr = False,  # x is AddRMSNorm's x: every program takes y = rms_norm(x + residual) itself
    RMS_BLOCK: tl.constexpr = 16,  # RMS: the row's tiles for its sum of squares (add_rmsnorm_quant's)
    RMS_CHUNKS: tl.constexpr = 1,
):
    wait_for_inputs(PDL)
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty  # the model dtype, which F.linear's logits are in
    rstd = 0.0
    if RMS:  # row_rmsnorm.py: the norm kernel's arithmetic; program 0 writes residual_out
        rstd = row_rstd(x_ptr, r_ptr, ro_ptr, nw_ptr, H, eps, tl.program_id(0) == 0, RMS_BLOCK, RMS_CHUNKS, HW)
    # ---- logits of this program's experts: fp32 dot products over H, rounded as F.linear's output;
    # the row's max |x| on the way (every program reads all of x)
    pid = tl.program_id(0)
    rows = pid * EXPERTS + tl.arange(0, EXPERTS)
    cols = tl.arange(0, BLOCK_H)
    acc = tl.zeros([EXPERTS, BLOCK_H], dtype=tl.float32)
    amax = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        mask = start + cols < H
        if RMS:
            x = normed_value(x_ptr, r_ptr, nw_ptr, start + cols, mask, rstd, HW)
        else:
            x = tl.load(x_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + (start + cols)[None, :],
                    mask=(rows[:, None] < E) & mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        acc += w * x[None, :]
    tl.store(logits_ptr + rows, round_to(tl.sum(acc, axis=1), DTYPE, HW), mask=rows < E)
    # ---- per-token FP8 quantization of x, a slice per program (quantize_row's scale and codes)
    scale = quant_scale(tl.max(amax, axis=0))
    part = pid * SLICE + tl.arange(0, SLICE)
    if RMS:
        xv = normed_value(x_ptr, r_ptr, nw_ptr, part, part < H, rstd, HW)
    else:
        xv = tl.load(x_ptr + part, mask=part < H, other=0.0).to(tl.float32)
    tl.store(xq_ptr + part, fp8_e4m3_code(xv, scale, tl.math.div_rn(1.0, scale), HW, FNUZ), mask=part < H)
    if pid == 0:
        tl.store(xs_ptr, fp8_scale(scale, FNUZ))
    # ---- the program that finishes last routes: every other program's logits are stored by then
    tl.debug_barrier()  # this program's stores, before its release
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.store(counter_ptr, 0)  # for the next launch (a captured graph replays this one)
        experts = tl.arange(0, BLOCK_E)
        logits = tl.load(logits_ptr + experts, mask=experts < E, other=float("-inf"), volatile=True)
        _route(logits, 0, E, weights_ptr, ids_ptr, TOP_K, NORM, BLOCK_E, BLOCK_TOPK)
        _lay_out_one(
            ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, amax_ptr, TOP_K, BLOCK_TOPK, BLOCK_M, BLOCK_PAIRS
        )


def _check_routing(x: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """x as rows, after the checks every routing launch makes (x's dtype and columns, E and k)."""
    check_model_dtype("x", x)
    x = rows_of("x", x)
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"the number of experts must be in 1..{MAX_EXPERTS}, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts} (the number of experts), got {top_k}")
    if x.shape[1] == 0:
        raise ValueError("x has no columns (H = 0)")
    return x


def _checked(logits: torch.Tensor, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_model_dtype("x", x)
    if not logits.is_floating_point():
        raise TypeError(f"router logits must be floating point, got {logits.dtype}")
    logits = rows_of("logits", logits)
    x = _check_routing(x, logits.shape[1], top_k)
    if x.shape[0] != logits.shape[0]:
        raise ValueError(f"logits [T, E] {tuple(logits.shape)} and x [T, H] {tuple(x.shape)} disagree on T")
    if logits.device != x.device:
        raise ValueError(f"logits and x must be on one device, got {logits.device} and {x.device}")
    return logits, x


def _one_token_layout(top_k: int, block_m: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """moe_align's buffers for one token's k pairs (moe_route_quant_one's layout)."""
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    return (
        torch.empty(top_k * block_m, dtype=torch.int32, device=dev),
        torch.empty(top_k, dtype=torch.int32, device=dev),
        torch.empty(1, dtype=torch.int32, device=dev),
        torch.empty(top_k * block_m, dtype=torch.float32, device=dev),
    )


def _outputs(tokens: int, hidden: int, top_k: int, dev: torch.device, fp8: torch.dtype) -> tuple[torch.Tensor, ...]:
    return (
        torch.empty(tokens, top_k, dtype=torch.float32, device=dev),
        torch.empty(tokens, top_k, dtype=torch.int32, device=dev),
        torch.empty(tokens, hidden, dtype=fp8, device=dev),
        torch.empty(tokens, 1, dtype=torch.float32, device=dev),
    )


def _launch(logits, x, outputs, top_k: int, norm_topk_prob: bool, max_block: int, pdl: bool, **layout) -> None:
    weights, ids, xq, xs = outputs
    block, chunks, num_warps = row_config(x.shape[1], max_block)
    _moe_route_quant_kernel[(x.shape[0],)](
        logits,
        x,
        weights,
        ids,
        xq.view(torch.uint8),
        xs,
        logits.shape[1],
        x.shape[1],
        logits.stride(0),
        x.stride(0),
        TOP_K=top_k,
        NORM=bool(norm_topk_prob),
        BLOCK_E=triton.next_power_of_2(logits.shape[1]),
        BLOCK_TOPK=triton.next_power_of_2(top_k),
        BLOCK=block,
        NUM_CHUNKS=chunks,
        HW=use_hw_casts(x),
        FNUZ=xq.dtype == torch.float8_e4m3fnuz,
        num_warps=num_warps,
        **layout,
        **launch_options(pdl),
    )


def moe_route_quant(
    logits: torch.Tensor,
    x: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    *,
    max_block: int = MAX_BLOCK,
    pdl: bool = False,
    fp8: torch.dtype = FP8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing and FP8 quantization of the MoE input in one launch.

    logits [T, E] (any float dtype), x [T, H] bf16 | fp16 | fp32 ->
    (topk_weights [T, k] fp32, topk_ids [T, k] int32, xq [T, H] fp8 e4m3, xs [T, 1] fp32), i.e.
    functional.moe_routing(logits, k, norm) (weights before the cast to the logits' dtype) and
    functional.dynamic_quant(x, 0). `max_block` caps x's register tile (tests force the chunked path).
    pdl: programmatic dependent launch (kernels/pdl.py). fp8 float8_e4m3fnuz (amd-gfx942): xq as
    e4m3fnuz with xs doubled (dynamic_quant's fp8).
    Raises ValueError on mismatched shapes or an unsupported E / k, TypeError on a dtype."""
    fnuz_format(fp8)
    logits, x = _checked(logits, x, top_k)
    outputs = _outputs(x.shape[0], x.shape[1], top_k, x.device, fp8)
    if x.shape[0] == 0:
        outputs[3].fill_(MIN_SCALE)
        return outputs
    _launch(logits, x, outputs, top_k, norm_topk_prob, max_block, pdl)
    return outputs


def moe_route_quant_one(
    logits: torch.Tensor,
    x: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    block_m: int,
    *,
    max_block: int = MAX_BLOCK,
    pdl: bool = False,
    fp8: torch.dtype = FP8,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """moe_route_quant of a single token (logits [1, E], x [1, H]), plus its pairs laid out as
    moe_align(topk_ids, E, block_m) lays them out up to the blocks' order, from the same launch:
    ((topk_weights, topk_ids, xq, xs), (sorted_pair_ids [k * block_m], block_expert [k],
    num_padded [1], row_amax [k * block_m] zeros)). fp8: as moe_route_quant's."""
    fnuz_format(fp8)
    logits, x = _checked(logits, x, top_k)
    if x.shape[0] != 1:
        raise ValueError(f"moe_route_quant_one routes one token, got {x.shape[0]}")
    layout = _one_token_layout(top_k, block_m, x.device)
    outputs = _outputs(1, x.shape[1], top_k, x.device, fp8)
    positions = top_k * block_m
    _launch(
        logits, x, outputs, top_k, norm_topk_prob, max_block, pdl,
        sorted_ptr=layout[0], block_expert_ptr=layout[1], num_padded_ptr=layout[2], amax_ptr=layout[3],
        LAYOUT=True, BLOCK_M=block_m, BLOCK_PAIRS=triton.next_power_of_2(positions),
    )  # fmt: skip
    return outputs, layout


def router_one_programs(num_experts: int, hidden: int) -> tuple[int, int, int]:
    """(router rows per program, programs, num_warps) of moe_router_one: a program per router row,
    one warp up to H = 2048, eight above. Measured on an H200 in CUDA graphs (E = 128, every
    combination of 1/2/4 rows and 1/2/4/8 warps): 4.39 µs at H = 2048, 5.80 µs at H = 4096, against
    6.58 and 9.45 µs for ~32 programs of 4 rows with the quantization in the last program's tail."""
    return 1, num_experts, 1 if hidden <= 2048 else 8


def moe_router_one(
    x: torch.Tensor,
    router_w: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    block_m: int,
    counter: torch.Tensor,
    *,
    pdl: bool = False,
    fp8: torch.dtype = FP8,
    rms: tuple | None = None,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """moe_route_quant_one(x · router_wᵀ, x, ...) with the router GEMV in the same launch: x [1, H],
    router_w [E, H] in x's dtype; the logits are fp32 sums of the products rounded to x's dtype (as
    F.linear's output is; its summation order may differ in the last bit). A program per router row
    (router_one_programs), each also taking max |x| as it reads x and quantizing its slice of x with
    it (quantize_row's scale and codes, bit for bit); the one that finishes last (an atomic count in
    `counter`, an int32 [1] of zero that it puts back) routes and lays out the pairs, so the serial
    tail is the top-k alone. Returns what moe_route_quant_one does (fp8: as moe_route_quant's).
    rms: (residual [1, H], norm weight [H], residual_out [1, H], eps): x is then AddRMSNorm's x, and
    the token routed and quantized is y = rms_norm(x + residual), which every program computes with
    add_rmsnorm's arithmetic (kernels/row_rmsnorm.py) and program 0 stores x + residual at
    residual_out: the norm's launch saved."""
    fnuz = fnuz_format(fp8)
    if router_w.dtype != x.dtype or router_w.dim() != 2 or router_w.shape[1] != x.shape[-1]:
        raise ValueError(f"router_w must be [E, {x.shape[-1]}] {x.dtype}, got {tuple(router_w.shape)} {router_w.dtype}")
    if counter.dtype != torch.int32 or counter.numel() != 1 or counter.device != x.device:
        raise ValueError("counter must be one int32 on x's device")
    num_experts = router_w.shape[0]
    x = _check_routing(x, num_experts, top_k)
    if x.shape[0] != 1:
        raise ValueError(f"moe_router_one routes one token, got {x.shape[0]}")
    router_w = rows_of("router_w", router_w)
    layout = _one_token_layout(top_k, block_m, x.device)
    dev, positions, hidden = x.device, top_k * block_m, x.shape[1]
    weights, ids, xq, xs = _outputs(1, hidden, top_k, dev, fp8)
    logits = torch.empty(num_experts, dtype=torch.float32, device=dev)
    per, programs, num_warps = router_one_programs(num_experts, hidden)
    residual, norm_w, residual_out, eps = rms if rms is not None else (x, x, x, 0.0)
    if rms is not None:
        for name, t, shape in (("residual", residual, (1, hidden)), ("residual_out", residual_out, (1, hidden)),
                               ("norm weight", norm_w, (hidden,))):  # fmt: skip
            if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device or t.stride(-1) != 1:
                raise ValueError(
                    f"{name} must be {list(shape)} {x.dtype} on {x.device}, got {tuple(t.shape)} {t.dtype}"
                )
    rms_block, rms_chunks, _ = row_config(hidden)
    _router_one_kernel[(programs,)](
        x, router_w, logits, counter, weights, ids, xq.view(torch.uint8), xs, *layout,
        num_experts, hidden, router_w.stride(0), residual, norm_w, residual_out, float(eps),
        TOP_K=top_k, NORM=bool(norm_topk_prob), BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_TOPK=triton.next_power_of_2(top_k), HW=use_hw_casts(x),
        BLOCK_M=block_m, BLOCK_PAIRS=triton.next_power_of_2(positions), EXPERTS=per,
        BLOCK_H=min(triton.next_power_of_2(hidden), max(64, MAX_ROUTER_TILE // per)),
        SLICE=triton.next_power_of_2(triton.cdiv(hidden, programs)),
        FNUZ=fnuz, RMS=rms is not None, RMS_BLOCK=rms_block, RMS_CHUNKS=rms_chunks,
        num_warps=num_warps,
        **launch_options(pdl),
    )  # fmt: skip
    return (weights, ids, xq, xs), layout
