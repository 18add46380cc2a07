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

    # ---- per-token FP8 quantization of x (as _dynamic_quant_kernel)
    scale = quantize_row(x_ptr + row * stride_x, xq_ptr + row * H, H, BLOCK, NUM_CHUNKS, HW)
    tl.store(xs_ptr + row, scale)


def moe_route_quant(
    logits: torch.Tensor, x: torch.Tensor, top_k: int, norm_topk_prob: bool, *, max_block: int = MAX_BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing and FP8 quantization of the MoE input in one launch.

    logits [T, E] (any float dtype), x [T, H] bf16 | fp16 | fp32 ->
    (topk_weights [T, k] fp32, topk_ids [T, k] int32, xq [T, H] fp8 e4m3, xs [T, 1] fp32), i.e.
    functional.moe_routing(logits, k, norm) (weights before the cast to the logits' dtype) and
    functional.dynamic_quant(x, 0). `max_block` caps x's register tile (tests force the chunked path).
    Raises ValueError on mismatched shapes or an unsupported E / k, TypeError on a dtype."""
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
    dev = x.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=dev)
    xq = torch.empty(tokens, hidden, dtype=FP8, device=dev)
    xs = torch.empty(tokens, 1, dtype=torch.float32, device=dev)
    if tokens == 0:
        xs.fill_(MIN_SCALE)
        return weights, ids, xq, xs
    block, chunks, num_warps = row_config(hidden, max_block)
    _moe_route_quant_kernel[(tokens,)](
        logits,
        x,
        weights,
        ids,
        xq.view(torch.uint8),
        xs,
        num_experts,
        hidden,
        logits.stride(0),
        x.stride(0),
        TOP_K=top_k,
        NORM=bool(norm_topk_prob),
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_TOPK=triton.next_power_of_2(top_k),
        BLOCK=block,
        NUM_CHUNKS=chunks,
        HW=use_hw_casts(x),
        num_warps=num_warps,
    )
    return weights, ids, xq, xs
