"""Where one engine step's GPU time goes, by kernel, for the step shapes a loaded server runs:
decode batches (graph replay, and eager so each launch shows) and mixed steps (decodes beside
prefill chunks, fresh or after a cached prefix: whole-step mixed graphs, or with --graphs
mixed,piecewise each shape also on the piecewise graphs). qwen3-8b ptpc-fp8 on random
weights, built as decode_bench builds it.

    python bench/step_kernels.py --workdir /tmp/q8b --out bench/results/step_kernels_qwen3-8b.json
    python bench/step_kernels.py --batches '' --mixed 5x23x64x2000,1x1x64x2000   # the prefix cache's steps

Each shape reports: the step's wall time measured over `--steps` steps (host + GPU, synchronised),
the GPU busy time (sum of kernel times), the number of kernel launches, and the top kernels; a
mixed step also its host time (until engine.step() returns, the step queued).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import qruntime
import torch
from compile_bench import gpu_report_header
from decode_bench import build_artifact


def _kernels(prof, steps: int, top: int) -> dict:
    rows = [
        {"kernel": e.key[:90], "us_per_step": round(e.device_time_total / steps, 1), "calls_per_step": e.count / steps}
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    rows.sort(key=lambda r: -r["us_per_step"])
    return {
        "gpu_us_per_step": round(sum(r["us_per_step"] for r in rows), 1),
        "launches_per_step": sum(r["calls_per_step"] for r in rows),
        "top": rows[:top],
    }


def _fill(engine, batch: int, context: int, max_tokens: int, salt: int = 0) -> list[str]:
    """`batch` requests of `context` random prompt tokens, prefilled, each now decoding (salt: another
    draw, so a second run of the same shape does not find the first one's prompts in the prefix cache)."""
    g = torch.Generator().manual_seed(batch * 7919 + context + salt * 1_000_003)
    ids = []
    for _ in range(batch):
        prompt = torch.randint(10, 100_000, (context,), generator=g).tolist()
        ids.append(engine.add_request(prompt, qruntime.SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    sched = engine.scheduler
    while sched.num_waiting or any(sched.get(i).num_computed_tokens < sched.get(i).num_tokens - 1 for i in ids):
        engine.step()
    return ids


def _measure(engine, steps: int, top: int, profile: bool = True) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    row = {"wall_ms_per_step": round((time.perf_counter() - start) / steps * 1e3, 3)}
    if profile:
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        row.update(_kernels(prof, steps, top))
    return row


def decode_rows(engine, batch: int, context: int, steps: int, top: int) -> dict:
    ids = _fill(engine, batch, context, max_tokens=8 * steps + 16)
    graphs = engine.runner.decode_graphs
    out = {"batch": batch, "context": context, "graph": _measure(engine, steps, top)}
    engine.runner.decode_graphs = None
    try:
        out["eager"] = _measure(engine, steps, top)
    finally:
        engine.runner.decode_graphs = graphs
    for i in ids:
        engine.abort(i)
    return out


def _host_profile(step, top: int) -> list[str]:
    """cProfile of one step: the functions with the most own time (ms), then the most in all."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(step)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive, own s, cumulative s, callers)}

    def named(key, value, index):
        return f"{key[2]} ({Path(key[0]).name}:{key[1]}): {value[index] * 1e3:.2f} ms, {value[0]} calls"

    own = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    cumulative = sorted(stats.items(), key=lambda kv: -kv[1][3])[:top]
    return [named(k, v, 2) for k, v in own] + ["-- cumulative --"] + [named(k, v, 3) for k, v in cumulative]


def mixed_rows(
    engine,
    decodes: int,
    prompts: int,
    prompt_len: int,
    context: int,
    top: int,
    prefix: int = 0,
    host_profile: bool = False,
    salt: int = 0,
) -> dict:
    """One step of `decodes` decoding sequences beside `prompts` prompts of `prompt_len` new tokens,
    repeated: each measured step admits a new set of prompts (all prefilled in that one step). With
    `prefix`, every prompt starts with the same `prefix` tokens, cached before (the prefix cache's
    case: short chunks after a long cached context). salt: fresh prompts for each run of a shape (the
    prefix cache would otherwise serve a second run the first one's)."""
    ids = _fill(engine, decodes, context, max_tokens=400, salt=salt)
    g = torch.Generator().manual_seed(prompts * 31 + prompt_len + prefix + salt * 1_000_003)
    shared = torch.randint(10, 100_000, (prefix,), generator=g).tolist()
    if prefix:
        engine.generate(shared + [7] * prompt_len, qruntime.SamplingParams(max_tokens=1))  # its blocks stay cached
        hits = engine.prefix_cache_stats.hits

    def admit() -> list[str]:
        return [
            engine.add_request(
                shared + torch.randint(10, 100_000, (prompt_len,), generator=g).tolist(),
                qruntime.SamplingParams(max_tokens=1, ignore_eos=True),
            )
            for _ in range(prompts)
        ]

    def one_step(profiled: bool) -> tuple[float, float, object]:
        admit()
        torch.cuda.synchronize()
        start = time.perf_counter()
        prof = None
        if profiled:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            host = time.perf_counter()
        else:
            engine.step()
            host = time.perf_counter()  # the step is queued: what the host spent launching it
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3, (host - start) * 1e3, prof

    for _ in range(3):
        one_step(False)  # warm-up: this shape's kernels compile
    runs = [one_step(False) for _ in range(5)]
    *_, prof = one_step(True)
    host_top = _host_profile(lambda: one_step(False), top) if host_profile else None
    for i in ids:
        engine.abort(i)
    row = {
        "decodes": decodes,
        "prompts": prompts,
        "prompt_len": prompt_len,
        "prefix": prefix,
        "tokens": decodes + prompts * prompt_len,
        "wall_ms": sorted(r[0] for r in runs)[len(runs) // 2],
        "host_ms": sorted(r[1] for r in runs)[len(runs) // 2],
        **_kernels(prof, 1, top),
    }
    if prefix:
        row["prefix_hit_tokens_per_step"] = (engine.prefix_cache_stats.hits - hits) / (len(runs) + 4 + bool(host_top))
    if host_top:
        row["host_top"] = host_top
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/q8b"))
    parser.add_argument("--batches", default="64,128", help="Decode batches to measure ('' for none).")
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument(
        "--mixed",
        default="64x16x128x0,112x16x128x0,0x16x128x0,64x4x128x0",
        help="Mixed steps to measure, comma-separated DECODESxPROMPTSxPROMPT_LENxPREFIX: PROMPTS prompts of "
        "PROMPT_LEN new tokens after a cached PREFIX-token prefix (0: fresh prompts) beside DECODES decodes.",
    )
    parser.add_argument(
        "--host-profile", action="store_true", help="Add a cProfile of one step of each mixed shape (host_top)."
    )
    parser.add_argument(
        "--graphs",
        default="mixed",
        help="How mixed steps run, comma-separated, each shape measured with each: mixed (whole-step graphs, "
        "the default engine), piecewise (the mixed graphs set aside: attention eager between captured pieces).",
    )
    parser.add_argument(
        "--no-pdl",
        action="store_true",
        help="Load without programmatic dependent launch: each kernel's profiled time is then its own (with PDL "
        "a kernel starts early and its span includes its wait for the one before, so spans overlap).",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if set(args.graphs.split(",")) - {"mixed", "piecewise"}:
        parser.error(f"--graphs takes mixed and/or piecewise, got {args.graphs!r}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = gpu_report_header("step_kernels", synthetic=True)
    timings: dict[str, float] = {}
    art, _ = build_artifact(args.preset, args.workdir, timings)
    batches = [int(b) for b in args.batches.split(",") if b]
    engine = qruntime.load(
        art,
        graph_capture="load",
        device="cuda",
        max_model_len=4096,
        max_num_seqs=max([*batches, 96]) + 32,
        max_num_batched_tokens=4096,
        kv_cache_memory=16 << 30,
        pdl=False if args.no_pdl else None,
    )
    report["pdl"] = not args.no_pdl
    report["engine"] = engine.description
    report["timings"] = timings
    report["decode"] = []
    for batch in batches:
        row = decode_rows(engine, batch, args.context, args.steps, args.top)
        print(json.dumps({k: v for k, v in row.items()}, indent=None)[:3000], flush=True)
        report["decode"].append(row)
    report["mixed"] = []
    mixed_graphs = engine.runner.mixed_graphs
    for spec in args.mixed.split(","):
        decodes, prompts, prompt_len, prefix = (int(x) for x in spec.split("x"))
        for salt, graphs in enumerate(args.graphs.split(",")):
            # mixed: whole-step graphs where they fit; piecewise: those set aside (attention eager)
            engine.runner.mixed_graphs = mixed_graphs if graphs == "mixed" else None
            row = mixed_rows(
                engine, decodes, prompts, prompt_len, args.context, args.top, prefix, args.host_profile, salt
            )
            row["graphs"] = graphs
            print(json.dumps(row)[:3000], flush=True)
            report["mixed"].append(row)
    engine.runner.mixed_graphs = mixed_graphs
    engine.close()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
