"""Issue-17 kernel bench: the PTPC FP8 linear at one token (batch-1 decode), GEMV against tiles.

For each weight shape of a preset's decoder layer (qkv, o, gate_up, down; a dense model's MLP, at
tp = TP as one rank holds it), ptpc_fp8_gemm at M = 1 captured `--calls` times back to back in a
CUDA graph, each call on another copy of the weight (so it comes from memory, not L2), µs per call:
- GEMV: the best of the GEMV candidates (GemmConfig block_m 1), with PDL and its L2 prefetch of
  the rows before the wait, and without PDL;
- tiles: the best 16-row tensor-core candidate with PDL (its prefetch of 1024 bytes a row), the
  split-K reduction launched, and "folded" (the partials only, as when the next kernel adds them).

    python bench/gemv_bench.py --shapes qwen3-8b:1,qwen3-30b-a3b:1,qwen3-30b-a3b:4 \\
        --out bench/results/gemv_bench_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from qruntime.benchmark import copy_bandwidth
from qruntime.kernels.fp8_gemm import ptpc_fp8_gemm, sweep_configs

sys.path.insert(0, str(Path(__file__).parent))

from compile_bench import gpu_report_header
from moe_decode_kernels import graph_us

from qcompile.synth import get_preset

ROTATE_BYTES = 400 << 20  # weight copies per shape: more than L2 holds


def layer_shapes(preset: str, tp: int) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one rank's decoder-layer linears (column-parallel qkv / gate_up, row-parallel o / down)."""
    c = get_preset(preset).config()
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    hidden, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    q, kv = heads // tp, max(1, kv // tp)  # key/value heads are replicated where tp exceeds them
    shapes = {"qkv": ((q + 2 * kv) * head_dim, hidden), "o": (hidden, q * head_dim)}
    if "num_experts" not in c:
        shapes["gate_up"] = (2 * c["intermediate_size"] // tp, hidden)
        shapes["down"] = (hidden, c["intermediate_size"] // tp)
    return shapes


def bench(name: str, n: int, k: int, calls: int, dev: torch.device) -> list[dict]:
    copies = max(2, ROTATE_BYTES // (n * k))
    gen = torch.Generator(device=dev).manual_seed(0)
    ws = [
        (torch.randn(n, k, device=dev, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        for _ in range(copies)
    ]
    scale = (torch.rand(n, 1, device=dev, generator=gen) * 2e-4 + 1e-4).to(torch.bfloat16)
    xq = (torch.randn(1, k, device=dev, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    xs = torch.rand(1, 1, device=dev, generator=gen) + 0.5

    def timed(config, **kw) -> float:
        return graph_us(
            [lambda i=i: ptpc_fp8_gemm(xq, xs, ws[i % copies], scale, config=config, **kw) for i in range(calls)]
        )

    cands = sweep_configs(1, n, k)
    gemvs, tiles = [c for c in cands if c.block_m == 1], [c for c in cands if c.block_m > 1]
    rows = []
    for label, configs, kw in (
        ("GEMV, PDL + L2 prefetch of its rows", gemvs, {"pdl": True, "prefetch_k": 1024}),
        ("GEMV, no PDL", gemvs, {}),
        ("tiles, PDL, split-K reduced", tiles, {"pdl": True, "prefetch_k": 1024}),
        ("tiles, PDL, partials only (folded)", tiles, {"pdl": True, "prefetch_k": 1024, "defer_reduce": True}),
    ):
        us, config = min(((timed(c, **kw), c) for c in configs), key=lambda t: t[0])
        rows.append(
            {
                "shape": name,
                "n": n,
                "k": k,
                "kernel": label,
                "us": round(us, 2),
                "gb_s": round(n * k / us / 1e3),
                "config": config.to_dict(),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-8b:1,qwen3-30b-a3b:1,qwen3-30b-a3b:4", help="PRESET:TP,...")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    report = gpu_report_header("gemv_bench", synthetic=True)
    report["copy_bandwidth_gb_s"] = round(copy_bandwidth() / 1e9)
    report["rows"] = []
    for item in args.shapes.split(","):
        preset, tp = item.split(":")
        for linear, (n, k) in layer_shapes(preset, int(tp)).items():
            report["rows"] += bench(f"{item} {linear}", n, k, args.calls, dev)
            torch.cuda.empty_cache()
    for r in report["rows"]:
        print(f"{r['shape']:>24} {r['n']:>6}x{r['k']:<6} {r['kernel']:>36} {r['us']:8.2f} µs {r['gb_s']:>6} GB/s")
    print(f"copy bandwidth {report['copy_bandwidth_gb_s']} GB/s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
