"""Fused W4A16 MoE against the fused FP8 MoE on one GPU, at qwen3-30b-a3b's expert shapes (issue 20).

One MoE layer (128 experts, top 8, hidden 2048, moe_intermediate 768) at T in 1, 8, 64, 1024 tokens,
each op as the runtime's MoE op runs it from the router logits (at one token the router GEMV inside
the routing launch, as at batch-1 decode):
  w4a16  kernels/fused_moe_w4a16.py: int4 experts in groups of 128 (bf16 scales), bf16 activations
  fp8    kernels/fused_moe.py: PTPC FP8 experts (per-row bf16 scales), per-token FP8 activations
Timed in CUDA graphs with qcompile.tune.gemm.time_us: calls rotate over weight copies (past 256 MiB)
and each routes its own tokens, as many calls as it takes for the experts they hit to add up to
256 MiB, so expert weights come from HBM, not L2; PDL where the GPU has it. Per T: µs per layer with the default config, and with --sweep the fastest of the tuner's
candidates (what `qcompile tune` would record); the bytes a call must move (the weights and scales
of the experts its routing hits, x in, y out) per µs as a share of the device copy bandwidth (read +
write, qruntime.benchmark.copy_bandwidth); each op's SQNR against the reference op (ops/moe.py).

    python bench/w4a16_moe_bench.py --sweep --out bench/results/w4a16_moe_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from compile_bench import gpu_report_header

from qcompile.tune.gemm import time_us
from qcompile.tune.moe import MoEShape, _random_experts

QWEN3_30B_A3B = {"num_experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}
TOKENS = (1, 8, 64, 1024)
GROUP = 128
ROTATE_BYTES = 256 << 20


def _shape(int4: bool) -> MoEShape:
    s = QWEN3_30B_A3B
    return MoEShape(s["num_experts"], s["inter"], s["hidden"], s["top_k"], True, group_size=GROUP if int4 else 0)


def _hit_experts(logits: torch.Tensor, top_k: int) -> int:
    return int(logits.float().topk(top_k, -1).indices.unique().numel())


def bench_kernel(int4: bool, tokens: int, sweep: bool, pdl: bool, dev: torch.device) -> dict:
    from qruntime.benchmark import sqnr_db
    from qruntime.kernels import fused_moe, fused_moe_w4a16
    from qruntime.ops.base import OpEnv
    from qruntime.ops.moe import MoE
    from triton.runtime.errors import OutOfResources

    shape = _shape(int4)
    e, i, h, k = shape.num_experts, shape.inter, shape.hidden, shape.top_k
    module = fused_moe_w4a16 if int4 else fused_moe
    copies = [_random_experts(shape, dev) for _ in range(max(2, -(-ROTATE_BYTES // (e * shape.expert_bytes()))))]
    # calls per graph: each routes its own tokens, enough that the experts they hit (a few at decode)
    # add up to ROTATE_BYTES, so a replay does not find the last one's experts in L2
    hit_bytes = min(e, tokens * k) * shape.expert_bytes()
    xs = [
        torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
        for _ in range(max(len(copies), -(-ROTATE_BYTES // hit_bytes)))
    ]
    router_w = torch.randn(e, h, device=dev, dtype=torch.bfloat16) * 0.05
    logits = [torch.nn.functional.linear(x, router_w) for x in xs]
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    extra = {"group_size": GROUP} if int4 else {}
    module_fn = fused_moe_w4a16.fused_moe_w4a16 if int4 else fused_moe.fused_moe

    def run(config, c: int):
        weights = copies[c % len(copies)]
        if tokens == 1:  # batch-1 decode: the router GEMV in the routing launch
            return module_fn(xs[c], None, *weights, k, True, config, (router_w, counter), pdl=pdl, **extra)
        return module_fn(xs[c], logits[c], *weights, k, True, config, pdl=pdl, **extra)

    default = module.default_config(tokens, e, i, h, k)
    timed = {}
    for config in [default, *module.sweep_configs(tokens, e, i, h, k)] if sweep else [default]:
        if config in timed:
            continue
        try:
            timed[config] = time_us([lambda c=c, config=config: run(config, c) for c in range(len(xs))])
        except OutOfResources:
            continue
    best = min(timed, key=timed.get)
    hit = sum(_hit_experts(lg, k) for lg in logits) / len(logits)
    nbytes = round(hit * shape.expert_bytes() + 2 * tokens * h * 2 + tokens * e * 2)
    linear = "W4A16Linear" if int4 else "PTPCLinear"
    attrs = {"num_experts": e, "top_k": k, "norm_topk_prob": True, "linear": linear, "group_size": shape.group_size}
    ref = MoE(attrs, OpEnv(torch.bfloat16, dev, None))(None, xs[0], router_w, *copies[0])
    out = {
        "default_us": round(timed[default], 2),
        "default_config": default.to_dict(),
        "bytes": nbytes,
        "experts_hit": hit,
        "sqnr_db": round(sqnr_db(ref, run(best, 0)), 1),
    }
    if sweep:
        out.update(best_us=round(timed[best], 2), best_config=best.to_dict(), candidates=len(timed))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    parser.add_argument("--sweep", action="store_true", help="also time the tuner's candidates, report the best")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("w4a16_moe_bench needs a CUDA GPU")
    from qruntime.benchmark import copy_bandwidth
    from qruntime.kernels import pdl_supported

    dev = torch.device("cuda")
    pdl = pdl_supported(dev)
    copy_bw = copy_bandwidth("cuda")  # bytes/s, read + write
    report = gpu_report_header("w4a16_moe_bench")
    report.update(
        copy_bandwidth_gbs=round(copy_bw / 1e9, 1),
        pdl=pdl,
        shape=QWEN3_30B_A3B | {"group_size": GROUP},
        weights="random (int4 bits, fp8)",
        sweep=args.sweep,
    )
    rows = []
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s, pdl {pdl}")
    us_key = "best_us" if args.sweep else "default_us"
    print(f"{'T':>5} {'w4a16 us':>9} {'%bw':>5} {'fp8 us':>8} {'%bw':>5} {'fp8/w4a16':>9}  ({us_key})")
    for tokens in map(int, args.tokens.split(",")):
        row = {"tokens": tokens}
        for kernel, int4 in (("w4a16", True), ("fp8", False)):
            result = bench_kernel(int4, tokens, args.sweep, pdl, dev)
            result["pct_copy_bw"] = round(100 * result["bytes"] / (result[us_key] * 1e-6) / copy_bw, 1)
            row[kernel] = result
            torch.cuda.empty_cache()
        row["fp8_over_w4a16"] = round(row["fp8"][us_key] / row["w4a16"][us_key], 3)
        rows.append(row)
        w4, f8 = row["w4a16"], row["fp8"]
        print(
            f"{tokens:>5} {w4[us_key]:>9.2f} {w4['pct_copy_bw']:>5.1f} {f8[us_key]:>8.2f} "
            f"{f8['pct_copy_bw']:>5.1f} {row['fp8_over_w4a16']:>9.3f}"
        )
    report["results"] = rows
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
