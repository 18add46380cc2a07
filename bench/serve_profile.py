"""Issue-16 profile on one GPU: where a serving step's time goes at each concurrency level.

Builds the same tuned qwen3-8b-shaped artifact as serve_bench.py, measures the engine alone (one
batch of C prompts decoded together, in its own process: the figure the server's TPOT is held to),
then serves it under bench/step_profile.py's timers and loads it with streamed 128-token prompts
that each generate 128 tokens (4 x C requests per level), as serve_bench.py does. Per level: the
client-side figures (output tok/s, TTFT, TPOT) beside the server's step records: how many steps ran
from a CUDA graph and how many eagerly (prefill chunks mixed in), each part's mean ms per step, the
GPU span of the forward, and the CPU use of the engine thread and of the asyncio thread.

    python bench/serve_profile.py --concurrency 64,128 --out bench/results/serve_profile_qwen3-8b.json

With --shared-prefix N it also runs serve_bench.py's shared-prefix workload (an N-token common
prefix + --question-len unique tokens, from --shared-concurrency clients) after the levels, and
keeps its step timeline (each step's time, tokens, decodes, requests added before it, wall and GPU
ms): where a cached request's first token waits.

    python bench/serve_profile.py --concurrency 64 --shared-prefix 2000 --out ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from compile_bench import gpu_report_header
from decode_bench import build_artifact
from loadgen import percentiles, random_token_specs, run_load, run_load_processes, summarize
from serve_bench import start_server
from step_profile import LOOP_KEYS, STEP_KEYS

HERE = Path(__file__).resolve().parent

ENGINE_ALONE = """
import json, sys, qruntime
from qruntime.benchmark import measure
art, batches, n_in, n_out = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
engine = qruntime.load(art, graph_capture="load", max_num_seqs=max(batches))
measure(engine, n_in, 8, max(batches), seed=1)  # warm-up: graphs captured, kernels loaded
print(json.dumps({b: measure(engine, n_in, n_out, b, seed=0) for b in batches}))
"""


def engine_alone(art: Path, batches: list[int], input_len: int, output_len: int) -> dict[int, dict[str, Any]]:
    """TTFT / TPOT of one batch of b equal-length prompts on the engine, no server, for each b."""
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_ALONE, str(art), ",".join(map(str, batches)), str(input_len), str(output_len)],
        capture_output=True,
        text=True,
        check=True,
    )
    return {int(b): row for b, row in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def _ms(values: list[float]) -> float | None:
    return round(statistics.fmean(values) * 1e3, 3) if values else None


def step_table(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean ms per step of every timed part, and the step mix, over `steps`."""
    keys = ("wall", "between", *LOOP_KEYS, *STEP_KEYS, "gpu")
    return {
        "steps": len(steps),
        "mean_tokens": round(statistics.fmean(s["tokens"] for s in steps), 1) if steps else None,
        "mean_decodes": round(statistics.fmean(s["decodes"] for s in steps), 1) if steps else None,
        "ms": {k: _ms([s.get(k, 0.0) for s in steps]) for k in keys},
    }


def cpu_use(threads: list[dict[str, Any]], t0: float, t1: float) -> dict[str, float]:
    """Each thread's CPU seconds per wall second between the snapshots nearest t0 and t1."""
    inside = [snap for snap in threads if t0 <= snap["t"] <= t1]
    if len(inside) < 2:
        return {}
    first, last = inside[0], inside[-1]
    span = last["t"] - first["t"]
    return {
        name: round((cpu - first["cpu_s"].get(name, 0.0)) / span, 3)
        for name, cpu in last["cpu_s"].items()
        if cpu - first["cpu_s"].get(name, 0.0) > 0.01 * span
    }


def level_profile(profile: dict[str, Any], t0: float, t1: float, concurrency: int) -> dict[str, Any]:
    steps = [s for s in profile["steps"] if t0 <= s["t"] <= t1]
    graph = [s for s in steps if s["graph"]]
    eager = [s for s in steps if not s["graph"]]
    full = [s for s in graph if s["decodes"] == concurrency]
    wall = t1 - t0
    return {
        "wall_s": round(wall, 3),
        "steps_per_s": round(len(steps) / wall, 1),
        "engine_busy": round(sum(s["wall"] for s in steps) / wall, 3),  # fraction of wall inside Engine.step
        "eager_step_share": round(len(eager) / len(steps), 3) if steps else None,
        "eager_time_share": round(sum(s["wall"] for s in eager) / max(sum(s["wall"] for s in steps), 1e-9), 3),
        "all": step_table(steps),
        "graph": step_table(graph),
        "eager": step_table(eager),
        "graph_full_batch": step_table(full),
        "thread_cpu_per_wall_s": cpu_use(profile["threads"], t0, t1),
        # the HTTP process turning the engine's ids into text (serve/engine_client.py's Handle), per wall second
        "http_text_per_wall_s": round(
            sum(v for k, v in profile.get("http_text", {}).items() if t0 - 1 <= int(k) <= t1) / wall, 4
        ),
        "http_process_thread_cpu_per_wall_s": cpu_use(profile.get("http_threads", []), t0, t1),
    }


def timeline(profile: dict[str, Any], t0: float, t1: float) -> list[dict[str, Any]]:
    """Each step between t0 and t1: its start (ms after t0), size, requests added before it, wall and GPU ms."""
    rows = []
    for s in (s for s in profile["steps"] if t0 <= s["t"] <= t1):
        rows.append(
            {
                "t_ms": round((s["t"] - t0) * 1e3, 2),
                "tokens": s["tokens"],
                "chunks": s["chunks"],
                "decodes": s["decodes"],
                "added": s.get("added", 0),
                "graph": s["graph"],
                "wall_ms": round(s["wall"] * 1e3, 3),
                "gpu_ms": round(s["gpu"] * 1e3, 3) if "gpu" in s else None,
                "between_ms": round(s.get("between", 0.0) * 1e3, 3),
            }
        )
    return rows


def print_timeline(rows: list[dict[str, Any]], limit: int = 80) -> None:
    print(
        f"{'t ms':>9}{'tokens':>8}{'chunks':>8}{'decodes':>8}{'added':>7}{'graph':>7}{'wall':>9}{'gpu':>9}{'between':>9}"
    )
    for r in rows[:limit]:
        gpu = "-" if r["gpu_ms"] is None else f"{r['gpu_ms']:.2f}"
        print(
            f"{r['t_ms']:9.1f}{r['tokens']:8}{r['chunks']:8}{r['decodes']:8}{r['added']:7}{str(r['graph']):>7}"
            f"{r['wall_ms']:9.2f}{gpu:>9}{r['between_ms']:9.2f}"
        )


def client_requests(results: list[Any], clock: float, t0: float) -> list[dict[str, Any]]:
    """Each request's id and its send, first token and end in ms after t0 (time.time()), from the
    clients' perf_counter times (CLOCK_MONOTONIC, one clock for every process) shifted by `clock`."""

    def ms(t: float) -> float:
        return round((t + clock - t0) * 1e3, 2)

    return [
        {
            "id": r.chunks[0].get("id") if r.chunks else None,
            "sent_ms": ms(r.start),
            "first_ms": ms(r.chunk_times[0]) if r.chunk_times else None,
            "end_ms": ms(r.end),
        }
        for r in results
    ]


WAY_IN = (
    ("to_handler", "sent_ms", "arrive"),  # client send -> its handler starts in the HTTP process
    ("to_submit", "arrive", "submit"),  # -> the HTTP process hands it to the engine process (body, parse)
    ("pipe", "submit", "recv"),  # -> the engine process has it off the pipe
    ("pickup", "recv", "add"),  # -> the engine thread adds it to the engine
    ("to_first", "add", "first_ms"),  # -> the client has its first token (schedule, steps, the way back)
)


def way_in(requests: list[dict[str, Any]], profile: dict[str, Any], t0: float) -> dict[str, Any]:
    """Percentiles (ms) of each stage of the requests' way to their first token, joined by id with
    the server's stamps (step_profile.py)."""
    stages: dict[str, list[float]] = {name: [] for name, _, _ in WAY_IN}
    for r in requests:
        stamps = profile.get("requests", {}).get(r["id"] or "")
        if not stamps:
            continue
        at = {**{k: (v - t0) * 1e3 for k, v in stamps.items()}, "sent_ms": r["sent_ms"], "first_ms": r["first_ms"]}
        for name, start, end in WAY_IN:
            if at.get(start) is not None and at.get(end) is not None:
                stages[name].append((at[end] - at[start]) / 1e3)  # percentiles() takes seconds
    return {name: percentiles(values, (50, 90, 99)) if values else None for name, values in stages.items()}


def print_way_in(stages: dict[str, Any]) -> None:
    cells = [
        f"{name} p50/p90/p99 {v['p50']:.1f}/{v['p90']:.1f}/{v['p99']:.1f}"
        for name, v in stages.items()
        if v is not None
    ]
    print("way in (ms):", "; ".join(cells), flush=True)


def print_rounds(requests: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """Per round of sends (a gap of 20+ ms between sends starts one): when its requests were sent,
    reached the engine (the steps after which they were added) and got their first token."""
    sends = sorted(requests, key=lambda r: r["sent_ms"])
    rounds: list[list[dict[str, Any]]] = []
    for r in sends:
        if not rounds or r["sent_ms"] - rounds[-1][-1]["sent_ms"] > 20:
            rounds.append([])
        rounds[-1].append(r)
    for k, group in enumerate(rounds):
        first, last = group[0]["sent_ms"], group[-1]["sent_ms"]
        horizon = max((r["first_ms"] or first) for r in group)
        adds = [(row["t_ms"], row["added"]) for row in rows if first - 5 <= row["t_ms"] <= horizon and row["added"]]
        firsts = sorted(r["first_ms"] - first for r in group if r["first_ms"] is not None)
        print(
            f"round {k}: {len(group)} sent over {last - first:.1f} ms from t={first:.1f}; added to the engine "
            f"(ms after the first send, count): {[(round(t - first, 1), n) for t, n in adds][:12]}; "
            f"first tokens at {[round(f, 1) for f in firsts[:: max(1, len(firsts) // 8)]]} ms"
        )


def print_level(c: int, summary: dict[str, Any], prof: dict[str, Any], alone: dict[str, Any]) -> None:
    print(
        f"\n== {c} clients: {summary['output_tokens_per_s']:.0f} tok/s, TPOT p50 {summary['tpot_ms']['p50']:.2f} ms "
        f"(engine alone {alone['tpot_ms']:.2f} ms), TTFT p50/p99 {summary['ttft_ms']['p50']:.0f}/"
        f"{summary['ttft_ms']['p99']:.0f} ms; {prof['steps_per_s']} steps/s, engine busy {prof['engine_busy']:.0%}, "
        f"eager steps {prof['eager_step_share']:.0%} taking {prof['eager_time_share']:.0%} of step time",
        flush=True,
    )
    print(f"{'ms per step':14}" + "".join(f"{k:>10}" for k in ("all", "graph", "eager", "full")))
    for key in ("wall", "between", *LOOP_KEYS, *STEP_KEYS, "gpu"):
        row = [prof[part]["ms"][key] for part in ("all", "graph", "eager", "graph_full_batch")]
        print(f"{key:14}" + "".join(f"{'-' if v is None else f'{v:.3f}':>10}" for v in row))
    print("steps", [prof[p]["steps"] for p in ("all", "graph", "eager", "graph_full_batch")])
    print("thread CPU / wall", prof["thread_cpu_per_wall_s"], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/q8b"))
    parser.add_argument("--concurrency", default="64,128")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="The profiled server's sys.setswitchinterval, in seconds (default Python's).",
    )
    parser.add_argument("--serve-arg", action="append", default=[], help="An extra `qruntime serve` argument.")
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="After the levels, the shared-prefix workload with an N-token common prefix, and its step timeline.",
    )
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--shared-output-len", type=int, default=64)
    parser.add_argument("--shared-concurrency", type=int, default=32)
    parser.add_argument(
        "--client-processes",
        type=int,
        default=4,
        help="Client processes the load comes from (default 4, at most C), as in serve_bench.py.",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = gpu_report_header("serve_profile", synthetic=True)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    timings: dict = {}
    art, _ = build_artifact(args.preset, args.workdir, timings)
    print("built", timings, flush=True)
    alone = engine_alone(art, levels, args.input_len, args.output_len) if levels else {}
    print("engine alone", json.dumps(alone), flush=True)

    profile_path = args.workdir / "step_profile.json"
    profile_path.unlink(missing_ok=True)
    launcher = [sys.executable, str(HERE / "step_profile.py"), str(profile_path)]
    if args.switch_interval is not None:
        launcher += ["--switch-interval", str(args.switch_interval)]
    proc, url = start_server(art, max([*levels, args.shared_concurrency]), launcher=launcher, extra=args.serve_arg)
    windows, shared = [], None
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        rng = random.Random(0)
        warm = random_token_specs(4, args.input_len, 8, 500, rng, model)
        asyncio.run(run_load(url, warm, 4))
        for c in levels:
            specs = random_token_specs(4 * c, args.input_len, args.output_len, 500, rng, model)
            t0 = time.time()
            clock = time.time() - time.perf_counter()
            processes = min(args.client_processes, c)
            results, wall, client_cpu = run_load_processes(url, specs, c, processes)
            summary = summarize(results, wall, c)
            summary.update(client_processes=processes, client_cpu_per_wall=round(client_cpu, 3))
            summary["requests"] = client_requests(results, clock, t0)
            windows.append((c, t0, time.time(), summary))
        if args.shared_prefix:
            c = args.shared_concurrency
            warm_rng = random.Random(2)  # another prefix first, as serve_bench.py warms its servers
            other = [warm_rng.randrange(500) for _ in range(args.shared_prefix)]
            asyncio.run(run_load(url, random_token_specs(8, args.question_len, 8, 500, warm_rng, model, other), 8))
            rng = random.Random(1)
            prefix = [rng.randrange(500) for _ in range(args.shared_prefix)]
            specs = random_token_specs(4 * c, args.question_len, args.shared_output_len, 500, rng, model, prefix)
            t0 = time.time()
            clock = time.time() - time.perf_counter()  # the clients' perf_counter (CLOCK_MONOTONIC) to wall time
            processes = min(args.client_processes, c)
            results, wall, client_cpu = run_load_processes(url, specs, c, processes)
            summary = summarize(results, wall, c)
            summary.update(client_processes=processes, client_cpu_per_wall=round(client_cpu, 3))
            summary["requests"] = client_requests(results, clock, t0)
            shared = (c, t0, time.time(), summary)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    profile = json.loads(profile_path.read_text())
    runs = []
    for c, t0, t1, summary in windows:
        prof = level_profile(profile, t0, t1, c)
        print_level(c, summary, prof, alone[c])
        prof["way_in"] = way_in(summary["requests"], profile, t0)
        print_way_in(prof["way_in"])
        runs.append({"concurrency": c, "client": summary, "engine_alone": alone[c], "server_steps": prof})
    shared_run = None
    if shared is not None:
        c, t0, t1, summary = shared
        prof = level_profile(profile, t0, t1, c)
        print(f"\n== shared prefix of {args.shared_prefix} tokens, {c} clients", flush=True)
        print_level(c, summary, prof, {"tpot_ms": float("nan")})
        rows = timeline(profile, t0, t1)
        print_timeline(rows)
        print_rounds(summary["requests"], rows)
        prof["way_in"] = way_in(summary["requests"], profile, t0)
        print_way_in(prof["way_in"])
        shared_run = {
            "prefix_len": args.shared_prefix,
            "question_len": args.question_len,
            "output_len": args.shared_output_len,
            "concurrency": c,
            "client": summary,
            "server_steps": prof,
            "timeline": rows,
        }
    report.update(
        preset=args.preset,
        recipe="ptpc-fp8 (tuned)",
        input_len=args.input_len,
        output_len=args.output_len,
        serve_args=args.serve_arg,
        switch_interval=args.switch_interval,
        timings=timings,
        levels=runs,
        shared_prefix=shared_run,
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
