"""Issue-17/22 kernel bench: the fused MoE's launches at one token (batch-1 decode), on one GPU.

For each shape (a preset's MoE layer as one rank holds it at tp = TP), every launch alone, captured
`--calls` times back to back in a CUDA graph, each call routing to other experts (random routing
logits) so that the expert weights come from memory, not L2; µs per call (graph replays / calls,
the launch gaps included):
- router: moe_router_one (router GEMV + top-k + x's quantization + the pairs' layout);
- up / down: the grouped GEMMs (moe_up_silu / moe_down, best of fused_moe's grouped candidates)
  and the GEMVs (moe_up_one / moe_down_one, best of the GEMV candidates), with the bandwidth each
  reaches over the bytes of the k experts it reads;
- combine: moe_combine of the k rows.

    python bench/moe_decode_kernels.py --shapes qwen3-30b-a3b:1,qwen3-30b-a3b:4,qwen3-235b-a22b:4 \\
        --out bench/results/moe_decode_kernels_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from qruntime.benchmark import copy_bandwidth
from qruntime.kernels.fused_moe import sweep_configs
from qruntime.kernels.moe_combine import moe_combine
from qruntime.kernels.moe_gemm import PairBlocks, moe_down, moe_up_silu
from qruntime.kernels.moe_gemv import MoEGemvConfig, moe_down_one, moe_up_one
from qruntime.kernels.moe_routing import moe_route_quant_one, moe_router_one

sys.path.insert(0, str(Path(__file__).parent))

from compile_bench import gpu_report_header

from qcompile.synth import get_preset
from qcompile.tune.gemm import time_us


def graph_us(calls: list) -> float:
    """µs per call of `calls` captured back to back in one CUDA graph (the tuner's timer)."""
    return time_us(calls, replays=20)


def shape_of(preset: str, tp: int) -> dict[str, int]:
    config = get_preset(preset).config()
    inter = int(config["moe_intermediate_size"])
    if inter % tp:
        raise SystemExit(f"{preset}: moe_intermediate_size {inter} does not split {tp} ways")
    return {
        "experts": int(config["num_experts"]),
        "top_k": int(config["num_experts_per_tok"]),
        "inter": inter // tp,
        "hidden": int(config["hidden_size"]),
    }


def bench_shape(name: str, shape: dict[str, int], calls: int, dev: torch.device) -> list[dict]:
    e, k, inter, hidden = shape["experts"], shape["top_k"], shape["inter"], shape["hidden"]
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, hidden, device=dev, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    w2 = (torch.randn(e, hidden, inter, device=dev, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s13 = (torch.rand(e, 2 * inter, 1, device=dev, generator=gen) * 2e-4 + 1e-4).to(torch.bfloat16)
    s2 = (torch.rand(e, hidden, 1, device=dev, generator=gen) * 2e-4 + 1e-4).to(torch.bfloat16)
    xs = [torch.randn(1, hidden, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(calls)]
    routers = [torch.randn(e, hidden, device=dev, dtype=torch.bfloat16, generator=gen) * 0.05 for _ in range(calls)]
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    routed = [moe_route_quant_one(torch.randn(1, e, device=dev, generator=gen) * 3, x, k, True, 16) for x in xs]
    rows = []
    up_bytes, down_bytes = k * 2 * inter * hidden, k * inter * hidden

    def row(kernel: str, us: float, moved: int = 0, config=None) -> None:
        rows.append(
            {"shape": name, **shape, "kernel": kernel, "us": round(us, 2)}
            | ({"gb_s": round(moved / us / 1e3)} if moved else {})
            | ({"config": config.to_dict()} if config is not None else {})
        )

    row(
        "router (moe_router_one)",
        graph_us([lambda i=i: moe_router_one(xs[i], routers[i], k, True, 16, counter) for i in range(calls)]),
    )
    blocks = [PairBlocks(*layout, 16, k, k) for _, layout in routed]

    def grouped(cfg) -> tuple[float, float]:
        t13, t2 = (
            {key: getattr(t, key) for key in ("block_n", "block_k", "num_warps", "num_stages")}
            for t in (cfg.w13, cfg.w2)
        )

        def up(i: int) -> torch.Tensor:
            return moe_up_silu(routed[i][0][2], routed[i][0][3], w13, s13, blocks[i], torch.bfloat16, **t13)

        acts = [up(i) for i in range(calls)]
        down_calls = [lambda i=i: moe_down(acts[i], w2, s2, routed[i][0][0], blocks[i], **t2) for i in range(calls)]
        return graph_us([lambda i=i: up(i) for i in range(calls)]), graph_us(down_calls)

    def gemv(cfg) -> tuple[float, float]:
        def up(i: int) -> torch.Tensor:
            return moe_up_one(routed[i][0][2], routed[i][0][3], w13, s13, routed[i][0][1], torch.bfloat16, cfg.up)

        acts = [up(i) for i in range(calls)]
        down_calls = [lambda i=i: moe_down_one(acts[i], w2, s2, *routed[i][0][:2], cfg.down) for i in range(calls)]
        return graph_us([lambda i=i: up(i) for i in range(calls)]), graph_us(down_calls)

    candidates = sweep_configs(1, e, inter, hidden, k)
    for label, timer, configs in (
        ("grouped GEMM (moe_up_silu / moe_down)", grouped, [c for c in candidates if not isinstance(c, MoEGemvConfig)]),
        ("GEMV (moe_up_one / moe_down_one)", gemv, [c for c in candidates if isinstance(c, MoEGemvConfig)]),
    ):
        timed = [(timer(cfg), cfg) for cfg in configs]
        (up_us, _), up_cfg = min(timed, key=lambda t: t[0][0])
        (_, down_us), down_cfg = min(timed, key=lambda t: t[0][1])
        row(f"up, {label}", up_us, up_bytes, up_cfg)
        row(f"down, {label}", down_us, down_bytes, down_cfg)
    pairs = torch.randn(k, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    row("combine (moe_combine)", graph_us([lambda: moe_combine(pairs, k) for _ in range(calls)]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b:1,qwen3-30b-a3b:4,qwen3-235b-a22b:4", help="PRESET:TP,...")
    parser.add_argument("--calls", type=int, default=40, help="calls per graph, each routed anew")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    report = gpu_report_header("moe_decode_kernels", synthetic=True)
    report["copy_bandwidth_gb_s"] = round(copy_bandwidth() / 1e9)
    report["rows"] = []
    for item in args.shapes.split(","):
        preset, tp = item.split(":")
        report["rows"] += bench_shape(item, shape_of(preset, int(tp)), args.calls, dev)
        torch.cuda.empty_cache()
    for r in report["rows"]:
        bw = f"{r['gb_s']:>6} GB/s" if "gb_s" in r else ""
        print(f"{r['shape']:>20} {r['kernel']:>32} {r['us']:8.2f} µs {bw}")
    print(f"copy bandwidth {report['copy_bandwidth_gb_s']} GB/s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
