"""W4A16 GEMM against the FP8 GEMM on one GPU, at qwen3-8b's linear shapes (issue 20).

For each (N, K) of qkv, o, gate_up and down and M in 1, 16, 1024, 4096 tokens, times in CUDA graphs:
  w4a16  kernels/w4a16_gemm.py: x [M,K] bf16 times int4 weights in groups of 128 (N*K/2 bytes +
         bf16 scales), with its default config, and (unless --no-tune) every candidate the tuner
         tries (sweep_configs: at one token the GEMVs beside the tiles): the best is `tuned`
  fp8    kernels/fp8_gemm.py (ptpc_fp8_gemm) with its default config: xq [M,K] fp8 with per-token
         scales times an fp8 weight (N*K bytes); the activation's quantization is not timed
Each call of a graph reads its own weight copy (qcompile.tune.gemm.time_us: 256 MiB of copies, so
weights come from HBM, not L2), kernels launch with PDL where the GPU has it, as the runtime's do.
Reported: µs per call, the bytes each must move (weights, scales, activations in, output out) per
µs as a share of the measured device copy bandwidth (read + write, qruntime.benchmark.copy_bandwidth),
fp8 µs over w4a16 µs (default and tuned), and the W4A16 outputs' largest error against the
reference math (relative to its largest value; a wrong config is refused).

    python bench/w4a16_bench.py --out bench/results/w4a16_gemm_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from compile_bench import gpu_report_header

from qcompile.tune.gemm import time_us

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
TOKENS = (1, 16, 1024, 4096)
MAX_ERROR = 2**-7  # as the tuner's: a bf16 output is off by ~2^-8 at most; a wrong kernel by ~1
GROUP = 128
ROTATE_BYTES = 256 << 20


def _copies(nbytes: int) -> int:
    return max(2, -(-ROTATE_BYTES // nbytes))


def bench_w4a16(m: int, n: int, k: int, pdl: bool, tune: bool) -> dict:
    """The default config's µs (a wrong default ends the run), and with `tune` the fastest
    candidate's; a candidate that does not build or run on this GPU (e.g. a pipeline deeper than
    its shared memory) or gives a wrong result is left out and listed under "failed"."""
    from qruntime.kernels.w4a16_gemm import default_config, sweep_configs, w4a16_gemm
    from qruntime.ops.functional import dequantize_int4

    copies = []
    for _ in range(_copies(n * k // 2)):
        w = torch.randint(-(1 << 31), 1 << 31, (n, k // 8), device="cuda", dtype=torch.int32)
        ws = (torch.rand(n, k // GROUP, device="cuda") * 0.01 + 0.005).to(torch.bfloat16)
        copies.append((w, ws))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w, ws = copies[0]
    ref = x.float() @ dequantize_int4(w, ws, GROUP).float().T
    nbytes = n * k // 2 + ws.numel() * 2 + m * k * 2 + m * n * 2

    def run(config) -> dict:
        us = time_us([lambda c=c: w4a16_gemm(x, *c, GROUP, config, pdl=pdl) for c in copies])
        error = float((w4a16_gemm(x, w, ws, GROUP, config).float() - ref).abs().max() / ref.abs().max())
        if not error <= MAX_ERROR:
            raise ValueError(f"w4a16 {n}x{k} at {m} tokens with {config} is wrong: relative error {error:.3g}")
        return {"us": round(us, 2), "config": config.to_dict(), "max_rel_error": error}

    default = default_config(m, n, k, GROUP)
    try:
        result = {"bytes": nbytes, "default": run(default)}
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if tune:
        timed, failed = [result["default"]], []
        for config in sweep_configs(m, n, k, GROUP)[1:]:
            try:
                timed.append(run(config))
            except Exception as e:  # noqa: BLE001 (a candidate that fails is reported, not fatal)
                failed.append({"config": config.to_dict(), "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(f"  left out {tuple(config.to_dict().values())}: {failed[-1]['error'][:120]}", flush=True)
        result |= {"tuned": min(timed, key=lambda r: r["us"]), "candidates": len(timed), "failed": failed}
    return result


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


def _pct(nbytes: int, us: float, copy_bw: float) -> float:
    return round(100 * nbytes / (us * 1e-6) / copy_bw, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated M values")
    parser.add_argument("--no-tune", action="store_true", help="time the default configs only")
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
    rows, start = [], time.perf_counter()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s, pdl {pdl}")
    print(
        f"{'linear':8} {'M':>5} {'w4a16 us':>9} {'%bw':>5} {'tuned us':>9} {'%bw':>5} {'fp8 us':>8} {'%bw':>5} "
        f"{'w4a16/fp8':>9} {'tuned/fp8':>9}  tuned config (block_m n k split warps stages swap packed)"
    )
    for name, (n, k) in QWEN3_8B.items():
        for m in map(int, args.tokens.split(",")):
            row = {"linear": name, "n": n, "k": k, "m": m}
            w4 = bench_w4a16(m, n, k, pdl, not args.no_tune)
            for run in (w4["default"], w4.get("tuned")):
                if run is not None:
                    run["pct_copy_bw"] = _pct(w4["bytes"], run["us"], copy_bw)
            f8 = bench_fp8(m, n, k, pdl)
            f8["pct_copy_bw"] = _pct(f8["bytes"], f8["us"], copy_bw)
            row |= {"w4a16": w4, "fp8": f8}
            tuned = w4.get("tuned", w4["default"])
            row["w4a16_over_fp8"] = round(w4["default"]["us"] / f8["us"], 3)
            row["tuned_over_fp8"] = round(tuned["us"] / f8["us"], 3)
            rows.append(row)
            print(
                f"{name:8} {m:>5} {w4['default']['us']:>9.2f} {w4['default']['pct_copy_bw']:>5.1f} "
                f"{tuned['us']:>9.2f} {tuned['pct_copy_bw']:>5.1f} {f8['us']:>8.2f} {f8['pct_copy_bw']:>5.1f} "
                f"{row['w4a16_over_fp8']:>9.3f} {row['tuned_over_fp8']:>9.3f}  {tuple(tuned['config'].values())}",
                flush=True,
            )
            torch.cuda.empty_cache()
    report["results"] = rows
    print(f"{time.perf_counter() - start:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
