"""Issue-4 benchmark on one GPU, in one run: qwen3-8b shapes (random weights, synthesized here),
compiled with ptpc-fp8, then measured in the same process against HF transformers bf16 on the same
weights and against the bandwidth floor (bytes a decode step reads / measured copy bandwidth).

    python bench/decode_bench.py --preset qwen3-8b --workdir /tmp/q8b --out bench/results/decode_bench_qwen3-8b.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import qruntime
import torch
from compile_bench import gpu_report_header
from qruntime.artifact import read_manifest
from qruntime.benchmark import copy_bandwidth, decode_step_bytes, measure

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe
from qcompile.synth import get_preset, write_checkpoint


def build_artifact(
    preset: str, workdir: Path, timings: dict[str, float], tune: bool = True
) -> tuple[Path, dict | None]:
    """Synthesize PRESET (random weights) and compile it with ptpc-fp8 under workdir, reusing what is
    already there; tune it on this GPU when `tune`. Returns (artifact, the tuned kernel table or None)
    and records synth_s / compile_s / tune_s in `timings`."""
    ckpt, art = workdir / preset, workdir / f"{preset}-ptpc-fp8"
    start = time.perf_counter()
    if not (ckpt / "config.json").exists():
        write_checkpoint(get_preset(preset).config(), ckpt, seed=0)
    timings["synth_s"] = time.perf_counter() - start
    start = time.perf_counter()
    if not (art / "manifest.json").exists():
        compile_checkpoint(prepare(ckpt, load_recipe("ptpc-fp8")), art, workers=16, progress=False)
    timings["compile_s"] = time.perf_counter() - start
    if not tune:
        return art, None
    from qcompile.tune.artifact import tune_artifact

    start = time.perf_counter()
    tuned = json.loads(tune_artifact(art).read_text())
    timings["tune_s"] = time.perf_counter() - start
    return art, tuned


def hf_tpot_ms(ckpt: Path, steps: int = 16) -> float:
    """HF transformers bf16 eager, batch 1: ms per decode token with its KV cache (greedy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(0, 1000, (1, 128), device="cuda")
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False)
        torch.cuda.synchronize()
        total = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - start
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return (total - prefill) / steps * 1e3


def decode_profile(
    engine, context: int = 160, steps: int = 4, top: int = 14, graphs: bool = False, batch: int = 1
) -> list[dict]:
    """Where a decode step's GPU time goes (`batch` requests decoding, 1 by default): µs per step by
    kernel name, largest first. Eager by default, so each kernel is visible (neither the decode
    graphs nor the piecewise ones, which would pad the step to their smallest bucket); `graphs`:
    the captured decode graph's own kernels, as they run (at tp > 1 the only way: rank 0 alone
    running eagerly would wait on the other ranks' graphs). Each row also has its share of the
    steps' kernel time; the last row, "(all kernels)", their sum per step."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.runner
    saved = runner.decode_graphs, runner.piecewise_graphs
    if not graphs:
        runner.decode_graphs = runner.piecewise_graphs = None
    try:
        requests = [
            engine.add_request(
                [1 + (i * 7919 + j) % (engine.vocab_size - 1) for j in range(context)],
                qruntime.SamplingParams(max_tokens=steps + 64, ignore_eos=True),
            )
            for i in range(batch)
        ]
        sched = engine.scheduler
        while sched.num_waiting or any(sched.get(r).num_computed_tokens < context for r in requests):
            engine.step()  # the prompts' prefill: the decodes after it are what is profiled
        for _ in range(2):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        for request in requests:
            engine.abort(request)
        while engine.has_unfinished():  # a step left in flight (async scheduling)
            engine.step()
    finally:
        runner.decode_graphs, runner.piecewise_graphs = saved
    rows = [
        {"kernel": e.key[:90], "us_per_step": round(e.device_time_total / steps, 1), "calls_per_step": e.count / steps}
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    total = sum(r["us_per_step"] for r in rows)
    calls = sum(r["calls_per_step"] for r in rows)
    rows = sorted(rows, key=lambda r: -r["us_per_step"])[:top]
    for r in rows:
        r["share"] = round(r["us_per_step"] / total, 3) if total else None
    return [*rows, {"kernel": "(all kernels)", "us_per_step": round(total, 1), "calls_per_step": calls, "share": 1.0}]


def replay_ms(engine, batch: int = 1, repeats: int = 50) -> float | None:
    """GPU time of one captured decode step (graph replay alone, no host work between steps): TPOT
    minus this is what the engine's host side adds per token."""
    graphs = engine.runner.decode_graphs
    if graphs is None:
        return None
    replay = graphs.replay_of(batch)
    replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/q8b"))
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--ttft-len", type=int, default=8000)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--no-tune", action="store_true", help="measure with default kernel configs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = gpu_report_header("decode_bench", synthetic=True)
    timings: dict[str, float] = {}
    art, tuned = build_artifact(args.preset, args.workdir, timings, tune=not args.no_tune)
    if tuned is not None:
        report["tuned"] = {
            shape: {bucket: (e["backend"], e["us"], e["cublaslt_us"]) for bucket, e in table.items()}
            for shape, table in tuned["entries"].items()
        }
    print("built", timings, flush=True)

    bandwidth = copy_bandwidth()
    manifest = read_manifest(art)
    batches = [int(b) for b in args.batches.split(",")]
    engine = qruntime.load(
        art,
        graph_capture="load",
        device="cuda",
        max_model_len=max(args.ttft_len, args.input_len + args.output_len) + 16,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(args.ttft_len, max(batches) * args.input_len),
        kv_cache_memory=16 << 30,
    )
    report["engine"] = engine.description
    measure(engine, 64, 8, 1)  # warm-up: triton compiles
    rows = []
    for batch in batches:
        measure(engine, args.input_len, 4, batch, seed=0)  # warm-up: this batch's prefill GEMM configs compile
        row = measure(engine, args.input_len, args.output_len, batch, seed=batch)
        context = args.input_len + args.output_len // 2
        floor_s = decode_step_bytes(manifest, batch, context) / bandwidth
        row["floor_ms"] = floor_s * 1e3
        row["tpot_over_floor"] = row["tpot_ms"] / row["floor_ms"]
        rows.append(row)
        print(row, flush=True)
    measure(engine, args.ttft_len, 2, 1, seed=6)  # warm-up: the large-M kernels compile on first use
    ttft = measure(engine, args.ttft_len, 2, 1, seed=7)
    print("ttft", ttft, flush=True)
    report["graph_replay_ms_batch1"] = replay_ms(engine)
    print("graph replay ms, batch 1:", report["graph_replay_ms_batch1"], flush=True)
    report["decode_profile_batch1"] = decode_profile(engine)
    for row in report["decode_profile_batch1"]:
        print(row, flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    hf = None if args.skip_hf else hf_tpot_ms(args.workdir / args.preset)
    print("hf bf16 tpot ms", hf, flush=True)
    report.update(
        timings=timings,
        copy_bandwidth_gb_s=bandwidth / 1e9,
        decode=rows,
        prefill={"input_len": args.ttft_len, "ttft_ms": ttft["ttft_ms"]},
        hf_bf16_eager_tpot_ms_batch1=hf,
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
