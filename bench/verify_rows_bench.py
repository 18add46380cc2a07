"""A speculative verification step two ways (engine/decode_rows.py): as decode rows (a decode graph,
one row per token: the runner's default up to its decode_rows_context) and as a mixed graph (one
query chunk a request), at several contexts, beside a plain decode step of the same batch.

Each (batch, context) cell prefills `batch` sequences of random tokens to `context`, then times a
step of k + 1 tokens a request wanting every row's logits (what a verification of k drafts runs),
synchronised after each step as a drafting round is (the host waits for the verdicts): the median
wall time over --repeats steps, the same positions rewritten each time. The crossover context, where
the decode rows' extra attention reads (every row reads its whole context) cost more than the mixed
graph's host work, sets decode_rows.DECODE_ROWS_CONTEXT.

    python bench/verify_rows_bench.py --preset qwen3-0.6b --batches 1,8 --contexts 256,1024,4096 --out FILE
    python bench/verify_rows_bench.py --artifact ART ...
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import qruntime  # noqa: E402
from compile_bench import bench_artifact, gpu_report_header, report_header  # noqa: E402
from qruntime.engine.decode_rows import decode_rows  # noqa: E402
from qruntime.engine.step_chunk import StepChunk  # noqa: E402

PREFILL_CHUNK = 2048  # tokens of a sequence's context computed a step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(runner: Any, chunks: list[StepChunk], wide: list[bool] | bool, repeats: int) -> float:
    """Median ms of runner.execute(chunks, wide) waited for, after two untimed steps."""
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        runner.execute(chunks, all_logits=wide)
        _sync(runner.device)
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cell(engine: Any, batch: int, context: int, drafts: int, repeats: int, rng: random.Random) -> dict[str, Any]:
    runner = engine.runner
    bs = runner.kv_cache.spec.block_size
    per_seq = -(-(context + drafts + 1) // bs)
    if batch * per_seq >= engine.scheduler.block_manager.num_blocks:
        raise SystemExit(
            f"batch {batch} at context {context} needs {batch * per_seq} KV blocks: give more --kv-cache-gib"
        )
    if runner.decode_graphs is None:
        raise SystemExit("verify_rows_bench times CUDA graphs: run it on a GPU (--device cuda)")
    tables = [tuple(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(batch)]
    vocab = engine.vocab_size
    tokens = [[rng.randrange(vocab) for _ in range(context + drafts + 1)] for _ in range(batch)]
    for s in range(batch):
        for start in range(0, context, PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, context)
            runner.execute([StepChunk(tuple(tokens[s][start:end]), start, tables[s])])
    n = drafts + 1
    verify = [StepChunk(tuple(tokens[s][context : context + n]), context, tables[s]) for s in range(batch)]
    decode = [StepChunk((tokens[s][context],), context, tables[s]) for s in range(batch)]
    replays, run = [], runner.decode_graphs.run
    runner.decode_graphs.run = lambda rows, *a: (replays.append(len(rows)), run(rows, *a))[1]
    limits = runner.decode_rows_reads, runner.decode_rows_max
    row: dict[str, Any] = {"batch": batch, "context": context, "drafts": drafts}
    runner.decode_rows_reads, runner.decode_rows_max = 1 << 62, batch * n  # every verification as decode rows
    row["decode_rows_ms"] = time_steps(runner, verify, [True] * batch, repeats)
    took_rows = replays.count(batch * n) == repeats + 2
    runner.decode_rows_reads = 0  # never: the mixed graph
    replays.clear()
    row["mixed_ms"] = time_steps(runner, verify, [True] * batch, repeats)
    took_mixed = not replays
    runner.decode_rows_reads, runner.decode_rows_max = limits
    row["decode_ms"] = time_steps(runner, decode, False, repeats)
    row["default_path"] = "decode rows" if decode_rows(verify, [True] * batch, *limits) else "mixed"
    runner.decode_graphs.run = run
    if not (took_rows and took_mixed):
        raise SystemExit(f"batch {batch}, context {context}: a timed step did not take the path it timed")
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-0.6b", help="a synthetic artifact of this preset (qcompile synth)")
    p.add_argument("--recipe", default="ptpc-fp8")
    p.add_argument("--artifact", type=Path, default=None, help="a compiled artifact instead of --preset's")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--contexts", default="256,1024,4096")
    p.add_argument("--drafts", type=int, default=4, help="k: a verification step computes k + 1 tokens a request")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--device", default="cuda", help="a CUDA device (the paths it times are CUDA graphs)")
    p.add_argument("--kv-cache-gib", type=float, default=16)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/qverifyrows"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    art = bench_artifact(p, args.artifact, args.preset, args.recipe, args.workdir)
    cuda = args.device == "cuda"
    report = (
        gpu_report_header("verify_rows_bench", synthetic=args.artifact is None)
        if cuda
        else report_header("verify_rows_bench")
    )
    source = {"artifact": str(art)} if args.artifact is not None else {"preset": args.preset, "recipe": args.recipe}
    report |= source | {"seed": seed, "rows": []}
    memory = {"kv_cache_memory": int(args.kv_cache_gib * (1 << 30))} | ({} if cuda else {"dtype": torch.float32})
    engine = qruntime.load(
        art,
        device=torch.device(args.device),
        max_model_len=max(contexts) + args.drafts + 1,
        max_num_seqs=max(256, max(batches)),
        prefix_cache=False,
        **memory,
    )
    report["engine"] = {k: engine.description.get(k) for k in ("backend", "cuda_graphs", "mixed_graphs", "kv_cache")}
    print(
        f"{'batch':>5} {'context':>7} {'decode rows':>11} {'mixed':>7} {'decode':>7} default (ms a step, k={args.drafts})"
    )
    for batch in batches:
        for context in contexts:
            row = cell(engine, batch, context, args.drafts, args.repeats, rng)
            report["rows"].append(row)
            print(
                f"{batch:>5} {context:>7} {row['decode_rows_ms']:>11.3f} {row['mixed_ms']:>7.3f} {row['decode_ms']:>7.3f} "
                f"{row['default_path']}",
                flush=True,
            )
    engine.close()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
