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
    quantize_row,
    row_config,
    rows_of,
    use_hw_casts,
)

MAX_EXPERTS = 4096  # the router row is one register tile


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
):
    row = tl.program_id(0).to(tl.int64)

    # ---- routing: fp32 softmax, top-k by repeated arg-max, optional renormalisation
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + row * stride_l + experts, mask=experts < E, other=float("-inf")).to(tl.float32)
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
    if LAYOUT:  # row 0 is the only token: pair s = slot s, in block s of expert top_i[s]
        tl.store(block_expert_ptr + slots, top_i, mask=slots < TOP_K)
        pos = tl.arange(0, BLOCK_PAIRS)
        used = pos < TOP_K * BLOCK_M
        tl.store(sorted_ptr + pos, tl.where(pos % BLOCK_M == 0, pos // BLOCK_M, TOP_K).to(tl.int32), mask=used)
        tl.store(amax_ptr + pos, tl.zeros([BLOCK_PAIRS], dtype=tl.float32), mask=used)
        tl.store(num_padded_ptr, TOP_K * BLOCK_M)

    # ---- per-token FP8 quantization of x (as _dynamic_quant_kernel)
    scale = quantize_row(x_ptr + row * stride_x, xq_ptr + row * H, H, BLOCK, NUM_CHUNKS, HW)
    tl.store(xs_ptr + row, scale)


def _checked(logits: torch.Tensor, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_model_dtype("x", x)
    if not logits.is_floating_point():
        raise TypeError(f"router logits must be floating point, got {logits.dtype}")
    logits, x = rows_of("logits", logits), rows_of("x", x)
    (tokens, num_experts), hidden = logits.shape, x.shape[1]
    if x.shape[0] != tokens:
        raise ValueError(f"logits [T, E] {tuple(logits.shape)} and x [T, H] {tuple(x.shape)} disagree on T")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"the number of experts must be in 1..{MAX_EXPERTS}, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts} (the number of experts), got {top_k}")
    if hidden == 0:
        raise ValueError("x has no columns (H = 0)")
    if logits.device != x.device:
        raise ValueError(f"logits and x must be on one device, got {logits.device} and {x.device}")
    return logits, x


def _outputs(tokens: int, hidden: int, top_k: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    return (
        torch.empty(tokens, top_k, dtype=torch.float32, device=dev),
        torch.empty(tokens, top_k, dtype=torch.int32, device=dev),
        torch.empty(tokens, hidden, dtype=FP8, device=dev),
        torch.empty(tokens, 1, dtype=torch.float32, device=dev),
    )


def _launch(logits, x, outputs, top_k: int, norm_topk_prob: bool, max_block: int, **layout) -> None:
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
        num_warps=num_warps,
        **layout,
    )


def moe_route_quant(
    logits: torch.Tensor, x: torch.Tensor, top_k: int, norm_topk_prob: bool, *, max_block: int = MAX_BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing and FP8 quantization of the MoE input in one launch.

    logits [T, E] (any float dtype), x [T, H] bf16 | fp16 | fp32 ->
    (topk_weights [T, k] fp32, topk_ids [T, k] int32, xq [T, H] fp8 e4m3, xs [T, 1] fp32), i.e.
    functional.moe_routing(logits, k, norm) (weights before the cast to the logits' dtype) and
    functional.dynamic_quant(x, 0). `max_block` caps x's register tile (tests force the chunked path).
    Raises ValueError on mismatched shapes or an unsupported E / k, TypeError on a dtype."""
    logits, x = _checked(logits, x, top_k)
    outputs = _outputs(x.shape[0], x.shape[1], top_k, x.device)
    if x.shape[0] == 0:
        outputs[3].fill_(MIN_SCALE)
        return outputs
    _launch(logits, x, outputs, top_k, norm_topk_prob, max_block)
    return outputs


def moe_route_quant_one(
    logits: torch.Tensor,
    x: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    block_m: int,
    *,
    max_block: int = MAX_BLOCK,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """moe_route_quant of a single token (logits [1, E], x [1, H]), plus its pairs laid out as
    moe_align(topk_ids, E, block_m) lays them out up to the blocks' order, from the same launch:
    ((topk_weights, topk_ids, xq, xs), (sorted_pair_ids [k * block_m], block_expert [k],
    num_padded [1], row_amax [k * block_m] zeros))."""
    logits, x = _checked(logits, x, top_k)
    if x.shape[0] != 1:
        raise ValueError(f"moe_route_quant_one routes one token, got {x.shape[0]}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    dev, positions = x.device, top_k * block_m
    outputs = _outputs(1, x.shape[1], top_k, dev)
    layout = (
        torch.empty(positions, dtype=torch.int32, device=dev),
        torch.empty(top_k, dtype=torch.int32, device=dev),
        torch.empty(1, dtype=torch.int32, device=dev),
        torch.empty(positions, dtype=torch.float32, device=dev),
    )
    _launch(
        logits, x, outputs, top_k, norm_topk_prob, max_block,
        sorted_ptr=layout[0], block_expert_ptr=layout[1], num_padded_ptr=layout[2], amax_ptr=layout[3],
        LAYOUT=True, BLOCK_M=block_m, BLOCK_PAIRS=triton.next_power_of_2(positions),
    )  # fmt: skip
    return outputs, layout
