"""Where the fused MoE's time goes: each launch of one MoE layer timed alone (CUDA graph of
back-to-back calls over weight copies, as bench/gpu_kernels/moe.py times the whole op).

    python bench/gpu_kernels/moe_stages.py      (with runtime/ on PYTHONPATH)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from moe import COPIES, SHAPES, experts, graph_us
from qruntime.kernels.fused_moe import _launch, default_config
from qruntime.kernels.moe_align import moe_align
from qruntime.kernels.moe_combine import moe_combine
from qruntime.kernels.moe_gemm import PairBlocks, moe_down, moe_up_silu
from qruntime.kernels.moe_routing import moe_route_quant

DTYPE = torch.bfloat16


def stages(shape: tuple[int, int, int, int], tokens: int, weights, router_w) -> dict[str, float]:
    e, k, h, i = shape
    cfg = default_config(tokens, e, i, h, k)
    xs = [torch.randn(tokens, h, device="cuda", dtype=DTYPE) for _ in weights]
    logits = [F.linear(x, router_w) for x in xs]
    routed = [moe_route_quant(lg, x, k, True) for lg, x in zip(logits, xs, strict=True)]
    aligned = [moe_align(r[1], e, cfg.block_m) for r in routed]
    blocks = [PairBlocks(*a, cfg.block_m, k, tokens * k) for a in aligned]
    acts = [
        moe_up_silu(r[2], r[3], w[0], w[1], b, DTYPE, **_launch(cfg.w13))
        for r, w, b in zip(routed, weights, blocks, strict=True)
    ]
    outs = [
        moe_down(a, w[2], w[3], r[0], b, **_launch(cfg.w2))
        for a, w, r, b in zip(acts, weights, routed, blocks, strict=True)
    ]
    n = len(weights)
    return {
        "router_gemm": graph_us(lambda c: F.linear(xs[c], router_w), n),
        "route_quant": graph_us(lambda c: moe_route_quant(logits[c], xs[c], k, True), n),
        "align": graph_us(lambda c: moe_align(routed[c][1], e, cfg.block_m), n),
        "up_silu": graph_us(
            lambda c: moe_up_silu(
                routed[c][2], routed[c][3], weights[c][0], weights[c][1], blocks[c], DTYPE, **_launch(cfg.w13)
            ),
            n,
        ),
        "down": graph_us(
            lambda c: moe_down(acts[c], weights[c][2], weights[c][3], routed[c][0], blocks[c], **_launch(cfg.w2)), n
        ),
        "combine": graph_us(lambda c: moe_combine(outs[c], k), n),
    }


def main() -> None:
    torch.manual_seed(0)
    for name, shape in SHAPES.items():
        e, _, h, i = shape
        weights = [experts(e, h, i, "cuda") for _ in range(COPIES)]
        router_w = torch.randn(e, h, device="cuda", dtype=DTYPE) * 0.05
        for tokens in (1, 8192):
            times = stages(shape, tokens, weights, router_w)
            total = sum(times.values())
            print(name, tokens, " ".join(f"{s}={us:.1f}" for s, us in times.items()), f"sum={total:.1f} us", flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
