"""W4A16 GEMM against the FP8 GEMM on one GPU, at qwen3-8b's linear shapes (issue 20).

For each (N, K) of qkv, o, gate_up and down and M in 1, 16, 1024 tokens, times in CUDA graphs:
  w4a16  kernels/w4a16_gemm.py with its default config: x [M,K] bf16 times int4 weights in groups
         of 128 (N*K/2 bytes + bf16 scales)
  fp8    kernels/fp8_gemm.py (ptpc_fp8_gemm) with its default config: xq [M,K] fp8 with per-token
         scales times an fp8 weight (N*K bytes); the activation's quantization is not timed
Each call of a graph reads its own weight copy (qcompile.tune.gemm.time_us: 256 MiB of copies, so
weights come from HBM, not L2), kernels launch with PDL where the GPU has it, as the runtime's do.
Reported: µs per call, the bytes each must move (weights, scales, activations in, output out) per
µs as a share of the measured device copy bandwidth (read + write, qruntime.benchmark.copy_bandwidth),
and the W4A16 output's largest error against the reference math (relative to its largest value).

    python bench/w4a16_bench.py --out bench/results/w4a16_gemm_h100.json
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

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
TOKENS = (1, 16, 1024)
GROUP = 128
ROTATE_BYTES = 256 << 20


def _copies(nbytes: int) -> int:
    return max(2, -(-ROTATE_BYTES // nbytes))


def bench_w4a16(m: int, n: int, k: int, pdl: bool) -> dict:
    from qruntime.kernels.w4a16_gemm import default_config, w4a16_gemm
    from qruntime.ops.functional import dequantize_int4

    copies = []
    for _ in range(_copies(n * k // 2)):
        w = torch.randint(-(1 << 31), 1 << 31, (n, k // 8), device="cuda", dtype=torch.int32)
        ws = (torch.rand(n, k // GROUP, device="cuda") * 0.01 + 0.005).to(torch.bfloat16)
        copies.append((w, ws))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    config = default_config(m, n, k, GROUP)
    us = time_us([lambda c=c: w4a16_gemm(x, *c, GROUP, config, pdl=pdl) for c in copies])
    w, ws = copies[0]
    ref = x.float() @ dequantize_int4(w, ws, GROUP).float().T
    error = float((w4a16_gemm(x, w, ws, GROUP, config).float() - ref).abs().max() / ref.abs().max())
    nbytes = n * k // 2 + ws.numel() * 2 + m * k * 2 + m * n * 2
    return {"us": round(us, 2), "bytes": nbytes, "config": config.to_dict(), "max_rel_error": error}


def bench_fp8(m: int, n: int, k: int, pdl: bool) -> dict:
    from qruntime.kernels.fp8_gemm import default_config, ptpc_fp8_gemm
    from qruntime.ops.functional import dynamic_quant

    copies = []
    for _ in range(_copies(n * k)):
        w = (torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn)
        ws = (torch.rand(n, 1, device="cuda") * 1e-3 + 1e-4).to(torch.bfloat16)
        copies.append((w, ws))
    xq, xs = dynamic_quant(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), 0)
    config = default_config(m, n, k)
    us = time_us([lambda c=c: ptpc_fp8_gemm(xq, xs, *c, torch.bfloat16, config, pdl=pdl) for c in copies])
    nbytes = n * k + n * 2 + m * k + m * 4 + m * n * 2
    return {"us": round(us, 2), "bytes": nbytes, "config": config.to_dict()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated M values")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("w4a16_bench needs a CUDA GPU")
    from qruntime.benchmark import copy_bandwidth
    from qruntime.kernels import pdl_supported

    pdl = pdl_supported(torch.device("cuda"))
    copy_bw = copy_bandwidth("cuda")  # bytes/s, read + write
    report = gpu_report_header("w4a16_bench")
    report.update(
        copy_bandwidth_gbs=round(copy_bw / 1e9, 1), pdl=pdl, group_size=GROUP, weights="random (int4 bits, fp8)"
    )
    rows = []
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s, pdl {pdl}")
    print(f"{'linear':8} {'M':>5} {'w4a16 us':>9} {'%bw':>5} {'fp8 us':>8} {'%bw':>5} {'fp8/w4a16':>9}")
    for name, (n, k) in QWEN3_8B.items():
        for m in map(int, args.tokens.split(",")):
            row = {"linear": name, "n": n, "k": k, "m": m}
            for kernel, bench in (("w4a16", bench_w4a16), ("fp8", bench_fp8)):
                result = bench(m, n, k, pdl)
                result["pct_copy_bw"] = round(100 * result["bytes"] / (result["us"] * 1e-6) / copy_bw, 1)
                row[kernel] = result
            row["fp8_over_w4a16"] = round(row["fp8"]["us"] / row["w4a16"]["us"], 3)
            rows.append(row)
            w4, f8 = row["w4a16"], row["fp8"]
            print(
                f"{name:8} {m:>5} {w4['us']:>9.2f} {w4['pct_copy_bw']:>5.1f} {f8['us']:>8.2f} "
                f"{f8['pct_copy_bw']:>5.1f} {row['fp8_over_w4a16']:>9.3f}"
            )
            torch.cuda.empty_cache()
    report["results"] = rows
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
