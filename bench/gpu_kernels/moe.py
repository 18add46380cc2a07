"""The fused FP8 MoE (fast-path `MoE` op) on the GPU at Qwen3 MoE shapes: correctness and speed.

Shapes: qwen3-30b-a3b (E=128, k=8, H=2048, I=768) and qwen3-235b-a22b's per-GPU slice at tp=4
(E=128, k=8, H=4096, I=384); T in TOKENS. Random PTPC experts (fresh per run), random bf16 inputs
and router (so roughly uniform routing).

Correctness: the fast op (router GEMM + fused kernels, default or tuned-like config) against the
reference op (qruntime.ops.moe.MoE) on the same GPU: max |err|, its ratio to max |ref| and the SQNR.
The reference adds the k contributions in bf16, the kernel in fp32, so ~45-50 dB is the expected
agreement; ok = SQNR >= 30 dB and finite.

Timing: a CUDA graph of COPIES back-to-back calls, each on its own weight copy and its own x (so
its own routing): the active experts are read from HBM, not from an L2 warmed by the call before;
replayed 20 times, median µs per call (as qcompile/tune/gemm.py times its candidates). Bandwidth counts
the bytes of the experts each call hits (distinct experts x FP8 w13 + w2 bytes and their scales),
averaged over the copies; at decode that is the whole cost, so GB/s against the device-to-device
copy bandwidth says how close the kernel is to the floor. ref_us: the reference op, eager (it
syncs with the host). The expert load (pairs per expert) of copy 0: hit experts, max and mean.

    python bench/gpu_kernels/moe.py [--sweep]      (with runtime/ on PYTHONPATH)

--sweep also times every candidate of sweep_configs and reports the fastest (what `qcompile tune`
would record).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import traceback

import torch
import torch.nn.functional as F
import triton
from fp8_gemm import copy_bandwidth, graph_us  # a sibling: bench/gpu_kernels is on sys.path
from qruntime.benchmark import sqnr_db
from qruntime.kernels.fused_moe import MoEConfig, default_config, sweep_configs
from qruntime.kernels.moe_align import expert_load
from qruntime.ops import functional as fn
from qruntime.ops import moe, triton_ops
from qruntime.ops.base import OpEnv

from qcompile.tune.moe import MoEShape

SHAPES = {  # name: (E, k, H, I)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-235b-a22b/tp4": (128, 8, 4096, 384),
}
TOKENS = (1, 4, 16, 64, 512, 8192)
COPIES = 4  # weight sets per graph: 4 x ~600 MB, far past any L2
DTYPE = torch.bfloat16
MIN_SQNR_DB = 30.0


def eager_us(call, reps: int = 3) -> float:
    call()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _quant_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.to(torch.bfloat16)


def experts(e: int, h: int, i: int, device: str) -> tuple[torch.Tensor, ...]:
    """Random PTPC experts (w13 [E, 2I, H], w13_scale, w2 [E, H, I], w2_scale), built expert by
    expert to keep the fp32 temporaries small."""
    w13 = torch.empty(e, 2 * i, h, dtype=torch.float8_e4m3fn, device=device)
    w2 = torch.empty(e, h, i, dtype=torch.float8_e4m3fn, device=device)
    s13 = torch.empty(e, 2 * i, 1, dtype=torch.bfloat16, device=device)
    s2 = torch.empty(e, h, 1, dtype=torch.bfloat16, device=device)
    for x in range(e):
        w13[x], s13[x] = _quant_rows(torch.randn(2 * i, h, device=device) * 0.02)
        w2[x], s2[x] = _quant_rows(torch.randn(h, i, device=device) * 0.02)
    return w13, s13, w2, s2


def bench_shape(name: str, shape: tuple[int, int, int, int], tokens: int, weights, router_w, copy_gbps, sweep):
    e, k, h, i = shape
    device = router_w.device
    attrs = {"num_experts": e, "top_k": k, "norm_topk_prob": True, "linear": "PTPCLinear", "group_size": 0}
    ref_op = moe.MoE(attrs, OpEnv(DTYPE, device, None))
    fast_op = triton_ops.MoE(attrs, OpEnv(DTYPE, device, None))
    xs = [torch.randn(tokens, h, device=device, dtype=DTYPE) for _ in range(len(weights))]
    loads = [expert_load(fn.moe_routing(F.linear(x, router_w), k, True)[1], e) for x in xs]
    hit = statistics.mean(int((load > 0).sum()) for load in loads)
    nbytes = hit * MoEShape(e, i, h, k, True).expert_bytes()

    ref = ref_op(None, xs[0], router_w, *weights[0])
    y = fast_op(None, xs[0], router_w, *weights[0])
    err = (y.float() - ref.float()).abs().max().item()
    sqnr = sqnr_db(ref, y)
    ok = bool(torch.isfinite(y).all()) and sqnr >= MIN_SQNR_DB

    def timed(config: MoEConfig) -> float:
        fast_op.configs[tokens] = config
        return graph_us(lambda c: fast_op(None, xs[c], router_w, *weights[c]), len(weights))

    default = default_config(tokens, e, i, h, k)
    us = timed(default)
    top = torch.topk(loads[0], 3)
    row = {
        "shape": name,
        "tokens": tokens,
        "us": round(us, 2),
        "gbps": round(nbytes / (us * 1e-6) / 1e9, 1),
        "pct_copy_bw": round(100 * nbytes / (us * 1e-6) / 1e9 / copy_gbps, 1),
        "ref_us": round(eager_us(lambda: ref_op(None, xs[0], router_w, *weights[0])), 1),
        "experts_hit": hit,
        "max_load": int(loads[0].max()),
        "mean_load_hit": round(float(loads[0][loads[0] > 0].float().mean()), 2),
        "hot_experts": {int(x): int(n) for n, x in zip(top.values.tolist(), top.indices.tolist(), strict=True)},
        "max_err": err,
        "rel_err": err / max(ref.float().abs().max().item(), 1e-30),
        "sqnr_db": round(sqnr, 1),
        "ok": ok,
        "config": default.to_dict(),
    }
    if sweep:
        best = (us, default)
        for cand in sweep_configs(tokens, e, i, h, k)[1:]:
            try:
                cand_us = timed(cand)
            except triton.runtime.errors.OutOfResources:
                continue
            best = min(best, (cand_us, cand), key=lambda t: t[0])
        row |= {"best_us": round(best[0], 2), "best_config": best[1].to_dict()}
    return row


def run(device: str = "cuda", tokens: tuple[int, ...] = TOKENS, sweep: bool = False) -> list[dict]:
    """One row per (shape, tokens); a shape or token count that fails gives an error row, the rest go on."""
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth(device)
    rows: list[dict] = [{"shape": "copy 1 GiB d2d", "tokens": 0, "copy_gbps": round(copy_gbps, 1)}]
    for name, shape in SHAPES.items():
        e, _, h, i = shape
        weights = [experts(e, h, i, device) for _ in range(COPIES)]
        router_w = torch.randn(e, h, device=device, dtype=DTYPE) * 0.05
        for t in tokens:
            try:
                rows.append(bench_shape(name, shape, t, weights, router_w, copy_gbps, sweep))
            except Exception:  # report and go on: one failure must not hide the other rows
                rows.append({"shape": name, "tokens": t, "ok": False, "error": traceback.format_exc(limit=6)})
            print(rows[-1], flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    cols = ("shape", "tokens", "us", "gbps", "pct_copy_bw", "ref_us", "experts_hit", "max_load", "sqnr_db", "ok")
    cols += ("best_us",)
    print(" ".join(f"{c:>20}" for c in cols))
    for row in rows:
        if "copy_gbps" in row:
            print(f"copy bandwidth (1 GiB d2d, read+write): {row['copy_gbps']:.0f} GB/s")
        elif "error" in row:
            print(f"{row['shape']:>20} {row['tokens']:>20} ERROR\n{row['error']}")
        else:
            print(" ".join(f"{str(row.get(c, '')):>20}" for c in cols))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time every sweep_configs candidate")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    args = parser.parse_args()
    result = run(tokens=tuple(int(t) for t in args.tokens.split(",")), sweep=args.sweep)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_bench.json"), "w") as f:
            json.dump(result, f, indent=1)
    print_table(result)
