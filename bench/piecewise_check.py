"""Piecewise CUDA graphs (engine/piecewise_graphs.py) against the eager plan, on one GPU: the same
greedy tokens and logits, and the time of the steps that have prefill in them.

qwen3-8b ptpc-fp8 on random weights, built and tuned as decode_bench builds it: a prefill-only step
of 2048 tokens and a mixed step (64 decodes at context 192 + one 1984-token prompt), eager and
piecewise on the same engine (its piecewise graphs set aside for the eager runs), their logits
compared; greedy generation of prompts long and short (chunked prefill, mixed steps) with and
without the piecewise graphs; the memory and time the capture takes. tiny-moe ptpc-fp8: the fused
MoE captured at every bucket up to 2048 tokens, greedy tokens the same as eager.

    PYTHONPATH=$PWD/runtime:$PWD:$PWD/bench python bench/piecewise_check.py --workdir /tmp/q8b \
        --out bench/results/piecewise_check_h100.json

--max-num-batched-tokens 8192 captures the buckets up to 8192 tokens (the capture's memory, which
the KV sizing's headroom must hold).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import qruntime
import torch
from compile_bench import gpu_report_header
from decode_bench import build_artifact
from qruntime.engine.piecewise_graphs import PiecewiseGraphs
from qruntime.engine.step_chunk import StepChunk

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe
from qcompile.synth import get_preset, write_checkpoint

GREEDY = qruntime.SamplingParams(max_tokens=24, ignore_eos=True)


def _time(runner, chunks, repeats: int) -> dict:
    """Median wall time of a step (synchronised) and of its host part (until execute returns)."""
    for _ in range(3):
        runner.execute(chunks)
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(chunks)
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
    return {"wall_ms": round(statistics.median(wall) * 1e3, 2), "host_ms": round(statistics.median(host) * 1e3, 2)}


def _gpu_ms(runner, chunks) -> float:
    """GPU busy time of one step: the sum of its kernels' times (graph replays' kernels included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.execute(chunks)
        torch.cuda.synchronize()
    return round(sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0) / 1e3, 2)


def _host_profile(runner, chunks, top: int = 8) -> list[str]:
    """Where one step's host time goes (cProfile, until execute returns): the top functions by own time."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    runner.execute(chunks)
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [f"{fn[2]} ({Path(fn[0]).name}:{fn[1]}): {v[2] * 1e3:.2f} ms, {v[1]} calls" for fn, v in rows]


def _compare(eager: torch.Tensor, piecewise: torch.Tensor) -> dict:
    e, p = eager.float(), piecewise.float()
    return {
        "max_abs_diff": float((e - p).abs().max()),
        "sqnr_db": round(float(10 * torch.log10(e.pow(2).mean() / (e - p).pow(2).mean().clamp(min=1e-30))), 1),
        "argmax_equal": f"{int((e.argmax(-1) == p.argmax(-1)).sum())}/{e.shape[0]}",
    }


def step_rows(engine, repeats: int, vocab: int) -> list[dict]:
    """The two step shapes, each eager and piecewise, on block tables of their own (the engine is idle)."""
    runner, bs = engine.runner, engine.runner.block_size
    g = torch.Generator().manual_seed(0)
    blocks = iter(range(engine.scheduler.config.num_blocks))

    def chunk(n: int, start: int) -> StepChunk:
        table = tuple(next(blocks) for _ in range(-(-(start + n) // bs)))
        return StepChunk(tuple(torch.randint(10, vocab, (n,), generator=g).tolist()), start, table)

    shapes = {
        "prefill 2048": [chunk(2048, 0)],
        "mixed 64 decodes + 1984 prefill": [chunk(1, 192) for _ in range(64)] + [chunk(1984, 0)],
        "prefill 512": [chunk(512, 0)],
        "prefill 256": [chunk(256, 0)],
        "prefill 100": [chunk(100, 0)],
        "mixed 32 decodes + 224 prefill": [chunk(1, 192) for _ in range(32)] + [chunk(224, 0)],
    }
    rows = []
    graphs = runner.piecewise_graphs
    for name, chunks in shapes.items():
        row = {"step": name, "tokens": sum(c.num_tokens for c in chunks)}
        row["piecewise"] = _time(runner, chunks, repeats)
        row["piecewise"]["gpu_ms"] = _gpu_ms(runner, chunks)
        row["piecewise_host_top"] = _host_profile(runner, chunks)
        piecewise_logits = runner.execute(chunks)
        runner.piecewise_graphs = None
        try:
            row["eager"] = _time(runner, chunks, repeats)
            row["eager"]["gpu_ms"] = _gpu_ms(runner, chunks)
            row["logits"] = _compare(runner.execute(chunks), piecewise_logits)
        finally:
            runner.piecewise_graphs = graphs
        row["speedup"] = round(row["eager"]["wall_ms"] / row["piecewise"]["wall_ms"], 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def greedy_row(engine, prompt_lens: list[int], vocab: int) -> dict:
    """Greedy tokens with the piecewise graphs and without (the prefix cache is off: both runs compute)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    graphs = engine.runner.piecewise_graphs
    used = []
    run = graphs.run
    graphs.run = lambda feeds, meta: (used.append(len(feeds["input_ids"])), run(feeds, meta))[1]
    with_graphs = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    del graphs.run
    engine.runner.piecewise_graphs = None
    try:
        eager = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    finally:
        engine.runner.piecewise_graphs = graphs
    same = [a == b for a, b in zip(with_graphs, eager, strict=True)]
    row = {
        "prompt_lens": prompt_lens,
        "same_tokens": f"{sum(same)}/{len(same)}",
        "piecewise_steps": len(used),
        "piecewise_step_tokens": sorted(set(used)),
    }
    if not all(same):
        row["first_divergence"] = [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            for a, b in zip(with_graphs, eager, strict=True)
        ]
    print(json.dumps(row), flush=True)
    return row


def capture_cost(engine) -> dict:
    """Memory and time of capturing the engine's buckets once more (then let go); held_eager_gib:
    the tensors eager code reads and writes at replay (attention's inputs and outputs, the tail's
    rows), each storage counted once."""
    runner = engine.runner
    graphs = runner.piecewise_graphs
    torch.cuda.synchronize()
    reserved, start = torch.cuda.memory_reserved(), time.perf_counter()
    again = PiecewiseGraphs(runner.plan, runner.kv_cache, graphs.buckets, graphs.scratch_block, graphs.max_context_len)
    torch.cuda.synchronize()
    seconds, grown = time.perf_counter() - start, torch.cuda.memory_reserved() - reserved
    held = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for stages in again.stages.values()
        for s in stages
        if not callable(s)
        for t in (*s.rows.values(), *s.into.values())
    }
    del again
    return {
        "buckets": list(graphs.buckets),
        "pieces_per_bucket": len(graphs.pieces),
        "capture_s": round(seconds, 2),
        "reserved_gib": round(grown / 2**30, 3),
        "held_eager_gib": round(sum(held.values()) / 2**30, 3),
    }


def moe_row(workdir: Path) -> dict:
    ckpt, art = workdir / "tiny-moe", workdir / "tiny-moe-ptpc-fp8"
    if not (ckpt / "config.json").exists():
        write_checkpoint(get_preset("tiny-moe").config(), ckpt, seed=0)
    if not (art / "manifest.json").exists():
        compile_checkpoint(prepare(ckpt, load_recipe("ptpc-fp8")), art, workers=4, progress=False)
    engine = qruntime.load(art, device="cuda", max_model_len=4096, kv_cache_memory=1 << 30, prefix_cache=False)
    row = {"engine": engine.description}
    row["greedy"] = greedy_row(engine, [3000, 1500, 700, 300, 90, 17, 5, 1], 544)
    engine.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/q8b"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="the engine's token budget: its largest bucket"
    )
    parser.add_argument("--code", default=None, help="what code ran, recorded as is (e.g. a commit and its changes)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = gpu_report_header("piecewise_check", synthetic=True)
    if args.code:
        report["code"] = args.code
    timings: dict[str, float] = {}
    art, _ = build_artifact("qwen3-8b", args.workdir, timings)
    start = time.perf_counter()
    engine = qruntime.load(
        art,
        device="cuda",
        max_model_len=max(4096, args.max_num_batched_tokens),
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=16 << 30,
        prefix_cache=False,
    )
    timings["load_s"] = time.perf_counter() - start
    report.update(engine=engine.description, timings=timings)
    print(json.dumps(report["engine"]), flush=True)

    def save() -> None:  # after each part: a run cut short keeps what it measured
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")

    report["steps"] = step_rows(engine, args.repeats, 151936)
    save()
    report["greedy"] = greedy_row(engine, [3000, 2047, 1200, 600, 130, 40, 7, 1], 151936)
    save()
    report["capture"] = capture_cost(engine)
    print(json.dumps(report["capture"]), flush=True)
    save()
    engine.close()
    report["tiny_moe"] = moe_row(args.workdir)
    save()


if __name__ == "__main__":
    main()
