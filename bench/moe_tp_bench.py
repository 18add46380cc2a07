"""Issue-7 benchmark: MoE models on one GPU and across the GPUs of one host, on SYNTHETIC artifacts.

Each run `PRESET:TP` writes a synthetic artifact (`qcompile synth PRESET --artifact --tp TP`: the
real graph, manifest and tokenizer, sparse weight files) whose random weights are made on the GPUs
at load, tunes its GEMM and MoE shapes on this GPU for the buckets used, loads it with `tp=TP`
(TP processes over NCCL), then measures in one go:

- decode, batch 1, a short context: TPOT against the bandwidth floor of the bytes a step really
  reads on one rank (attention, the routed experts, router, norms, lm_head, KV) at the measured
  copy bandwidth of one GPU;
- the scenario: one request of `--input-len` prompt tokens and `--output-len` output tokens: TTFT
  and TPOT;
- the expert load of the scenario's prefill (tokens per expert, every MoE layer).

    python bench/moe_tp_bench.py --runs qwen3-30b-a3b:1 --out bench/results/moe_bench_qwen3-30b-a3b.json
    python bench/moe_tp_bench.py --runs qwen3-30b-a3b:1,qwen3-30b-a3b:2,qwen3-30b-a3b:4,qwen3-235b-a22b:4

Every number it prints comes from random weights and is labelled synthetic in the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import qruntime
import torch
from compile_bench import report_header
from decode_bench import decode_profile, replay_ms
from qruntime.benchmark import copy_bandwidth, measure, step_read_bytes

from qcompile.recipe.schema import load_recipe
from qcompile.synth.artifact import write_synthetic_artifact

SYNTHETIC = "SYNTHETIC: random weights generated on the GPUs at load (qcompile synth --artifact); speed only"


def build(preset: str, tp: int, workdir: Path, buckets: tuple[int, ...], timings: dict) -> Path:
    from qcompile.tune.artifact import tune_artifact

    art = workdir / f"{preset}-tp{tp}"
    shutil.rmtree(art, ignore_errors=True)
    start = time.perf_counter()
    write_synthetic_artifact(preset, art, load_recipe("ptpc-fp8"), tp=tp, progress=False)
    timings["synth_artifact_s"] = round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    tune_artifact(art, buckets=buckets)
    timings["tune_s"] = round(time.perf_counter() - start, 2)
    gc.collect()
    torch.cuda.empty_cache()  # the tuner's buffers: free for the engine
    return art


def moe_ops(engine) -> list:
    return [node.op for node in engine.runner.plan.nodes if hasattr(node.op, "expert_counts")]


def expert_load(engine, input_len: int) -> dict:
    """Tokens per expert over one prefill of `input_len` random tokens, every MoE layer."""
    ops = moe_ops(engine)
    if not ops:
        return {}
    for op in ops:
        op.expert_counts = torch.zeros(op.a["num_experts"], dtype=torch.int64, device=engine.runner.device)
    measure(engine, input_len, 1, 1, seed=11)
    counts = torch.stack([op.expert_counts for op in ops]).float()  # [layers, E]
    for op in ops:
        op.expert_counts = None
    per_layer_max_over_mean = counts.max(1).values / counts.mean(1)
    hottest = counts.sum(0).topk(5)
    return {
        "tokens": input_len,
        "layers": len(ops),
        "max_over_mean_per_layer": {
            "median": round(per_layer_max_over_mean.median().item(), 2),
            "max": round(per_layer_max_over_mean.max().item(), 2),
        },
        "idle_experts_per_layer_mean": round((counts == 0).float().sum(1).mean().item(), 2),
        "hottest_experts_all_layers": {int(i): int(c) for c, i in zip(hottest.values, hottest.indices, strict=True)},
        "layer0_tokens_per_expert": [int(c) for c in counts[0]],
    }


def without_ll(art: Path) -> None:
    """Set the tuned LL all-reduce limit of the artifact's table(s) to 0 (the `noll` mode's A/B), the
    manifest's entries of the tables with them."""
    from qruntime.artifact import read_manifest

    from qcompile.compile.manifest import relist_files

    rels = []
    for table in (art / "kernels").glob("*.json"):
        data = json.loads(table.read_text())
        for key, buckets in data["entries"].items():
            if key.startswith("AllReduce:"):
                for cfg in buckets.values():
                    cfg["max_ll_bytes"] = 0
        table.write_text(json.dumps(data, indent=1) + "\n")
        rels.append(f"kernels/{table.name}")
    relist_files(art, read_manifest(art), rels)


def run_one(
    preset: str,
    tp: int,
    args,
    bandwidth: float,
    custom_all_reduce: bool = True,
    async_scheduling: bool = True,
    ll: bool = True,
) -> dict:
    timings: dict[str, float] = {}
    art = build(preset, tp, args.workdir, tuple(int(b) for b in args.tune_buckets.split(",")), timings)
    if not ll:
        without_ll(art)
    print(preset, "tp", tp, "built", timings, flush=True)
    start = time.perf_counter()
    engine = qruntime.load(
        art,
        graph_capture="load",
        device="cuda",
        tp=tp,
        max_model_len=args.input_len + args.output_len + 64,
        max_num_seqs=1,
        max_num_batched_tokens=max(args.input_len, 256),
        kv_cache_memory=8 << 30,
        custom_all_reduce=custom_all_reduce,
        pdl=False if args.no_pdl else None,
    )
    engine.async_scheduling = engine.async_scheduling and async_scheduling
    timings["load_s"] = round(time.perf_counter() - start, 2)
    row: dict = {
        "preset": preset,
        "tp": tp,
        "custom_all_reduce": custom_all_reduce,
        "ll_all_reduce": ll,
        "async_scheduling": engine.async_scheduling,
        "pdl": not args.no_pdl,
        "weights": SYNTHETIC,
        "engine": engine.description,
        "timings": timings,
    }
    try:
        measure(engine, 64, 8, 1, seed=1)  # warm-up: triton compiles
        short = measure(engine, args.short_len, args.short_out, 1, seed=2)
        spec = engine.runner.kv_cache.spec
        kv_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * engine.runner.kv_cache.k[0].element_size()
        moe = moe_ops(engine)
        top_k = moe[0].a["top_k"] if moe else None
        read = step_read_bytes(
            engine.runner.plan.weights, kv_token, 1, args.short_len + args.short_out // 2, experts_read=top_k
        )
        row["decode_b1"] = {
            **short,
            "bytes_read_per_step_one_rank": read,
            "floor_ms": read / bandwidth * 1e3,
            "tpot_over_floor": short["tpot_ms"] / (read / bandwidth * 1e3),
            "graph_replay_ms": replay_ms(engine) if tp == 1 else None,  # rank 0 alone would wait in its all-reduces
        }
        print(row["decode_b1"], flush=True)
        measure(engine, args.input_len, 2, 1, seed=3)  # warm-up: the large-M configs compile
        scenario = measure(engine, args.input_len, args.output_len, 1, seed=4)
        row["scenario"] = scenario
        print("scenario", scenario, flush=True)
        if args.profile:  # at tp > 1, rank 0's kernels in its decode graph (waits on the other ranks included)
            row["decode_profile_b1"] = decode_profile(engine, steps=8, top=24, graphs=tp > 1 or args.profile_graphs)
            for r in row["decode_profile_b1"]:
                print(r, flush=True)
        row["copy_bandwidth_gb_s_one_gpu"] = bandwidth / 1e9
        if args.row_out is not None:  # before close: a close that hangs must not lose the row
            args.row_out.write_text(json.dumps(row, indent=1) + "\n")
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    try:  # the routing of a prefill, counted by the MoE ops: eager steps (a captured graph skips the count)
        with qruntime.load(art, graph_capture="load", device="cuda", tp=tp, max_model_len=args.input_len + 64, max_num_seqs=1,
            max_num_batched_tokens=max(args.input_len, 256), kv_cache_memory=4 << 30, cuda_graphs=False,
        ) as engine:  # fmt: skip
            row["expert_load"] = expert_load(engine, min(args.input_len, 8192))
        print("expert load", json.dumps(row["expert_load"])[:400], flush=True)
        if args.row_out is not None:
            args.row_out.write_text(json.dumps(row, indent=1) + "\n")
    finally:
        gc.collect()
        torch.cuda.empty_cache()
        shutil.rmtree(art, ignore_errors=True)
    return row


def run_isolated(item: str, args) -> dict:
    """One PRESET:TP run in its own process (its GPUs, process group and memory are gone after it,
    and a run that fails or hangs past --run-timeout is recorded while the next one still runs)."""
    preset, tp, *mode = item.split(":")
    row_out = args.workdir / f"row-{preset}-tp{tp}{''.join(mode)}.json"
    row_out.unlink(missing_ok=True)
    passed = [a for a in sys.argv[1:] if not a.startswith("--runs") and a != args.runs]
    cmd = [sys.executable, __file__, *passed, "--one", item, "--row-out", str(row_out)]
    try:
        child = subprocess.Popen(cmd, start_new_session=True)  # its own group: its workers die with it
        try:
            if child.wait(timeout=args.run_timeout):
                raise subprocess.CalledProcessError(child.returncode, cmd[:4])
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            if not row_out.exists():
                raise
            print(f"{item}: measured, but its processes did not exit in time (killed)", flush=True)
        return json.loads(row_out.read_text())
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        print(f"{item}: FAILED ({exc})", flush=True)
        return {"preset": preset, "tp": int(tp), "error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--runs",
        default="qwen3-30b-a3b:1",
        help="comma-separated PRESET:TP[:nccl][:sync][:noll] (nccl: no custom all-reduce; sync: no async scheduling; noll: the tuned table without the LL all-reduce)",
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qmoe"))
    parser.add_argument("--input-len", type=int, default=8000)
    parser.add_argument("--output-len", type=int, default=500)
    parser.add_argument("--short-len", type=int, default=128)
    parser.add_argument("--short-out", type=int, default=64)
    parser.add_argument("--tune-buckets", default="1,8192")
    parser.add_argument("--profile", action="store_true", help="profile a batch-1 decode step by kernel")
    parser.add_argument(
        "--profile-graphs", action="store_true", help="at tp = 1 too, profile the decode graph's kernels (not eager)"
    )
    parser.add_argument(
        "--no-pdl",
        action="store_true",
        help="load without programmatic dependent launch: --profile's kernel times are then each kernel's own",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--run-timeout", type=float, default=300, help="seconds one PRESET:TP run may take")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: the child of one run
    parser.add_argument("--row-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.one is not None:
        preset, tp, *mode = args.one.split(":")
        bandwidth = copy_bandwidth()
        unknown = set(mode) - {"nccl", "sync", "noll"}
        if unknown:
            parser.error(f"--runs {args.one}: unknown mode(s) {sorted(unknown)} (nccl, sync, noll)")
        run_one(
            preset,
            int(tp),
            args,
            bandwidth,
            custom_all_reduce="nccl" not in mode,
            async_scheduling="sync" not in mode,
            ll="noll" not in mode,
        )
        return
    import triton

    report = report_header("moe_tp_bench")
    report["machine"]["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    report["versions"].update(torch=torch.__version__, triton=triton.__version__)
    report["weights"] = SYNTHETIC
    report["runs"] = []
    for item in args.runs.split(","):
        report["runs"].append(run_isolated(item, args))
        if args.out:  # written after every run: a later failure keeps the earlier rows
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    for r in report["runs"]:
        if "error" in r:
            print(f"{r['preset']:>16} tp={r['tp']}  FAILED")
            continue
        d, s = r["decode_b1"], r["scenario"]
        ar = "custom" if r.get("custom_all_reduce", True) else "nccl"
        ar += "" if r.get("async_scheduling", True) else " sync"
        print(
            f"{r['preset']:>16} tp={r['tp']} {ar:>11}  b1 TPOT {d['tpot_ms']:.2f} ms (floor {d['floor_ms']:.2f}, "
            f"x{d['tpot_over_floor']:.2f})  scenario TTFT {s['ttft_ms']:.0f} ms TPOT {s['tpot_ms']:.2f} ms"
        )


if __name__ == "__main__":
    main()
