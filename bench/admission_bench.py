"""Host cost of admitting a burst of prompts that hit the prefix cache: Scheduler.schedule() + update()
for one engine step (plain Python: no GPU, no torch).

Each run builds a fresh Scheduler, prefills and finishes one warm-up request of `--prefix` random
token ids plus `--tail` more (so the prefix's full blocks are cached and evictable), then adds a
burst of N requests of the same prefix and `--tail` random ids of their own, and times the one
schedule() that admits them all (the step budget is N * tail tokens, so the burst is one step) and
the update() that names the blocks it filled. The engine's single thread does this work before the
GPU can start the step, so it delays every burst request's first token.

Reported per burst size: the median (and min/max) over `--runs` fresh runs, in ms, of schedule,
update and both (wall time); the median of both in this thread's CPU time (less disturbed by other
processes on a busy machine: time the thread waits for a core is not counted); and a fingerprint
(sha256 of every chunk's request, start, length, block table and samples flag, the hits, and the
hash chains named) that must be the same before and after a change to the scheduler for the same
--seed: the timings compare equal work.

With --baseline RUNTIME_DIR (another tree's runtime/, e.g. `git archive <commit> | tar -x -C
/tmp/before`), each run is timed on that tree's scheduler too, alternating in this one process, and the
rows add the baseline's times and the median of the per-run ratios (baseline / this tree): on a shared
machine whose speed drifts (this 2-core one: one process runs up to 2x faster than the next), a ratio
of neighbouring runs is steadier than two medians taken apart. The fingerprints must agree.

    python bench/admission_bench.py --out bench/results/admission_bench_<commit>_cpu.json
    python bench/admission_bench.py --baseline /tmp/before/runtime --seed 1234
    PYTHONPATH=/tmp/before/runtime python bench/admission_bench.py --seed 1234   # only another tree's qruntime
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import qruntime.engine.request as request_module
import qruntime.engine.scheduler as scheduler_module
from compile_bench import report_header

ENGINE_MODULES = ("request", "prefix_cache", "block_manager", "scheduler")  # the scheduler's own imports first


def load_baseline(runtime: Path) -> tuple[ModuleType, ModuleType]:
    """(scheduler, request) modules of another tree's runtime/qruntime/engine, loaded beside this tree's:
    sys.modules names them as qruntime's only while they load (their imports bind to each other)."""
    engine = runtime / "qruntime" / "engine"
    names = [f"qruntime.engine.{name}" for name in ENGINE_MODULES]
    saved = {name: sys.modules.get(name) for name in names}
    loaded = {}
    try:
        for name, full in zip(ENGINE_MODULES, names, strict=True):
            path = engine / f"{name}.py"
            if not path.is_file():
                raise SystemExit(f"--baseline {runtime}: no {path}")
            spec = importlib.util.spec_from_file_location(full, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[full] = module
            spec.loader.exec_module(module)
            loaded[name] = module
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return loaded["scheduler"], loaded["request"]


def one_run(
    rng: random.Random,
    burst: int,
    prefix_len: int,
    tail: int,
    block_size: int,
    sched: ModuleType = scheduler_module,
    req: ModuleType = request_module,
) -> dict:
    """One fresh scheduler (of module `sched`, requests of `req`): warm the prefix, then time the burst's
    schedule() and update()."""
    Scheduler, SchedulerConfig, Request = sched.Scheduler, sched.SchedulerConfig, req.Request
    cfg = SchedulerConfig(
        num_blocks=20000,
        block_size=block_size,
        max_model_len=8192,
        max_num_seqs=max(256, burst),
        max_num_batched_tokens=max(2048, burst * tail),
        prefix_caching=True,
    )
    s = Scheduler(cfg)
    prefix = [rng.randrange(150000) for _ in range(prefix_len)]
    warm = Request("warm", prefix + [1] * tail, tail)
    s.add(warm)
    while not warm.output_token_ids:
        out = s.schedule()
        s.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
    s.finish("warm")
    for i in range(burst):
        s.add(Request(f"r{i}", prefix + [rng.randrange(150000) for _ in range(tail)], tail))
    c0, t0 = time.thread_time(), time.perf_counter()
    out = s.schedule()
    t1 = time.perf_counter()
    s.update(out, {c.request.request_id: 5 for c in out.chunks if c.samples})
    t2, c2 = time.perf_counter(), time.thread_time()
    if len(out.chunks) != burst:
        raise SystemExit(f"the burst of {burst} was not admitted in one step ({len(out.chunks)} chunks)")
    fp = hashlib.sha256()
    for c in out.chunks:
        fp.update(repr((c.request.request_id, c.start, c.num_tokens, c.block_table, c.samples)).encode())
        fp.update(b"".join(s._hashes[c.request.request_id]))
    fp.update(repr((s.prefix_cache_stats.queries, s.prefix_cache_stats.hits)).encode())
    return {
        "schedule_ms": (t1 - t0) * 1e3,
        "update_ms": (t2 - t1) * 1e3,
        "cpu_ms": (c2 - c0) * 1e3,
        "fingerprint": fp.hexdigest(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", default="8,32,128", help="burst sizes (requests admitted in one step)")
    parser.add_argument("--runs", type=int, default=9, help="fresh schedulers timed per burst size (median)")
    parser.add_argument("--prefix", type=int, default=2000, help="token ids of the shared, cached prefix")
    parser.add_argument("--tail", type=int, default=64, help="token ids of each request after the prefix")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    parser.add_argument("--out", type=Path, default=None, help="write the report JSON here")
    parser.add_argument(
        "--baseline", type=Path, default=None, help="another tree's runtime/ dir: time its scheduler too, paired"
    )
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"seed {seed}  qruntime scheduler from {scheduler_module.__file__}")
    baseline = load_baseline(args.baseline) if args.baseline is not None else None
    if baseline is not None:
        print(f"baseline scheduler from {baseline[0].__file__}")

    rows = []
    print(
        f"{'burst':>6} {'schedule ms':>12} {'update ms':>10} {'total ms':>9} {'min':>7} {'max':>7} {'cpu ms':>7}"
        "  fingerprint"
    )
    for burst in (int(b) for b in args.bursts.split(",")):
        # the same draws for every run of one size: the fingerprint must then agree across runs
        runs, base = [], []
        for _ in range(args.runs):
            if baseline is not None:
                draw = random.Random(seed * 1000 + burst)
                base.append(one_run(draw, burst, args.prefix, args.tail, args.block_size, *baseline))
            runs.append(one_run(random.Random(seed * 1000 + burst), burst, args.prefix, args.tail, args.block_size))
        prints = {r["fingerprint"] for r in runs + base}
        if len(prints) != 1:
            raise SystemExit(f"burst {burst}: runs of one seed scheduled differently ({len(prints)} fingerprints)")
        totals = [r["schedule_ms"] + r["update_ms"] for r in runs]
        row = {
            "burst": burst,
            "schedule_ms": round(statistics.median(r["schedule_ms"] for r in runs), 3),
            "update_ms": round(statistics.median(r["update_ms"] for r in runs), 3),
            "total_ms": round(statistics.median(totals), 3),
            "total_min_ms": round(min(totals), 3),
            "total_max_ms": round(max(totals), 3),
            "cpu_ms": round(statistics.median(r["cpu_ms"] for r in runs), 3),
            "fingerprint": prints.pop(),
        }
        if base:
            base_totals = [r["schedule_ms"] + r["update_ms"] for r in base]
            row["baseline_schedule_ms"] = round(statistics.median(r["schedule_ms"] for r in base), 3)
            row["baseline_update_ms"] = round(statistics.median(r["update_ms"] for r in base), 3)
            row["baseline_total_ms"] = round(statistics.median(base_totals), 3)
            row["speedup_paired_median"] = round(
                statistics.median(b / t for b, t in zip(base_totals, totals, strict=True)), 2
            )
        rows.append(row)
        print(
            f"{burst:>6} {row['schedule_ms']:>12.3f} {row['update_ms']:>10.3f} {row['total_ms']:>9.3f} "
            f"{row['total_min_ms']:>7.3f} {row['total_max_ms']:>7.3f} {row['cpu_ms']:>7.3f}  {row['fingerprint'][:16]}"
            + (f"  baseline {row['baseline_total_ms']:.3f} ms, {row['speedup_paired_median']:.2f}x" if base else "")
        )

    if args.out is not None:
        report = report_header("admission_bench")
        report.update(
            seed=seed,
            runs=args.runs,
            prefix_tokens=args.prefix,
            tail_tokens=args.tail,
            block_size=args.block_size,
            baseline=None if args.baseline is None else str(args.baseline),
            rows=rows,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
