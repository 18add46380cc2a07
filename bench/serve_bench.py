"""Issue-8 benchmark on one GPU, in one run: throughput vs concurrency through `qruntime serve`.

Synthesizes a checkpoint of the preset's exact shapes (random weights: clearly synthetic), compiles
it with ptpc-fp8, tunes the kernels on this GPU, starts `qruntime serve` on loopback, then sends
streamed completions of random --input-len token prompts that each generate exactly --output-len
tokens (ignore_eos) from C concurrent clients, for each C; 4 x C requests per level (at least 8),
sent from --client-processes processes, each recording its CPU use (a client that saturates its
core measures itself, not the server), and the Triton kernels built while each level ran.
--shared-prefix N adds the shared-prefix workload (an N-token common prefix + unique questions),
against a server with the prefix cache and one without, from the same client processes.
The anchor is vLLM's 13,377 output tok/s at 128 concurrent, 128 in / 128 out, on one H100.

    python bench/serve_bench.py --out bench/results/serve_bench_qwen3-8b.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from compile_bench import gpu_report_header
from decode_bench import build_artifact
from loadgen import random_token_specs, run_load, run_load_processes, summarize


def start_server(
    art: Path,
    max_num_seqs: int,
    timeout: float = 300,
    launcher: list[str] | None = None,
    extra: list[str] | tuple[str, ...] = (),
) -> tuple[subprocess.Popen, str]:
    """`qruntime serve` on a free port (started by `launcher`, default `python -m qruntime`; the
    profile uses its own); returns (process, url) once /health answers."""
    launcher = launcher or [sys.executable, "-m", "qruntime"]
    proc = subprocess.Popen(
        [
            *launcher,
            "serve",
            str(art),
            "--port",
            "0",
            "--max-num-seqs",
            str(max_num_seqs),
            "--graph-capture",
            "load",
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + timeout
    url = None
    while url is None:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError(f"qruntime serve exited with {proc.wait()} before it was ready")
        print("server:", line.rstrip(), flush=True)
        found = re.search(r"http://[0-9.]+:\d+", line)
        url = found.group(0) if found else None
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("qruntime serve was not ready in time")
    while httpx.get(f"{url}/health").status_code != 200:
        time.sleep(0.5)
    # keep reading its log (access lines, warnings): a full pipe would stall the server mid-run
    threading.Thread(target=_drain, args=(proc.stderr,), daemon=True).start()
    return proc, url


def triton_cache() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def triton_kernels() -> set[str]:
    """The kernels in Triton's cache on this machine (TRITON_CACHE_DIR, else ~/.triton/cache): one folder each."""
    cache = triton_cache()
    return {p.name for p in cache.iterdir() if p.is_dir()} if cache.is_dir() else set()


def kernels_built(before: set[str]) -> list[dict]:
    """What Triton built since `before`: each kernel's name, its signature as compiled (the argument
    attributes show an int specialized as 1 or a multiple of 16) and its launch metadata, beside the
    signatures and metadata of the same kernel's variants built before (what differs is what the
    warm-up missed)."""

    def described(folder: str) -> list[dict]:
        out = []
        for ttir in (triton_cache() / folder).glob("*.ttir"):
            head = next((line.strip() for line in ttir.read_text().splitlines() if "tt.func" in line), "")
            meta_path = ttir.with_suffix(".json")
            meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
            keep = ("num_warps", "num_stages", "shared")
            out.append({"name": ttir.stem, "signature": head, **{k: meta.get(k) for k in keep}})
        return out

    new = [k for folder in sorted(triton_kernels() - before) for k in described(folder)]
    names = {k["name"] for k in new}
    earlier = [k for folder in sorted(before) for k in described(folder) if k["name"] in names]
    return [{**k, "variants_before": [e for e in earlier if e["name"] == k["name"]]} for k in new]


def _drain(stream) -> None:
    for line in stream:
        if not line.startswith("INFO:"):
            print("server:", line.rstrip(), flush=True)


def levels_run(art: Path, levels: list[int], args: argparse.Namespace) -> tuple[list[dict], str]:
    """The random 128/128 load at each concurrency level, one server for all; its /metrics after."""
    proc, url = start_server(art, max(levels), extra=args.serve_arg)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        rng = random.Random(0)
        warm = random_token_specs(4, args.input_len, 8, 500, rng, model)
        asyncio.run(run_load(url, warm, 4))
        runs = []
        for c in levels:
            specs = random_token_specs(max(8, 4 * c), args.input_len, args.output_len, 500, rng, model)
            kernels = triton_kernels()
            processes = min(args.client_processes, c)
            results, wall, client_cpu = run_load_processes(url, specs, c, processes)
            summary = summarize(results, wall, c)
            # near 1.0 per process, the client and not the server sets the pace
            summary["client_processes"] = processes
            summary["client_cpu_per_wall"] = round(client_cpu, 3)
            # kernels Triton built while the level ran: each a stall of the engine (issue 24)
            summary["triton_kernels_built"] = kernels_built(kernels)
            keys = ("concurrency", "completed", "output_tokens_per_s", "client_cpu_per_wall")
            print(json.dumps({k: summary[k] for k in keys}), flush=True)
            for kernel in summary["triton_kernels_built"]:
                print("  built during the level:", kernel["name"], kernel["signature"][:300], flush=True)
            print("  ttft", summary["ttft_ms"], "\n  tpot", summary["tpot_ms"], flush=True)
            runs.append(summary)
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return runs, metrics


def shared_prefix_runs(art: Path, args: argparse.Namespace) -> dict[str, dict]:
    """The same shared-prefix requests (one common prefix, unique questions) against a fresh server
    with the prefix cache on, then with it off; the cache's counters from /metrics."""
    c = args.shared_concurrency
    out = {}
    for name, extra in (("cache_on", []), ("cache_off", ["--no-prefix-cache"])):
        proc, url = start_server(art, c, extra=[*args.serve_arg, *extra])
        try:
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            # warm-up on another prefix: kernels meet long contexts and chunked prefill before the
            # timed run (Triton compiles them on first use), without caching the timed run's prefix
            warm_rng = random.Random(2)
            other = [warm_rng.randrange(500) for _ in range(args.shared_prefix)]
            asyncio.run(run_load(url, random_token_specs(8, args.question_len, 8, 500, warm_rng, model, other), 8))
            rng = random.Random(1)  # the same prompts for both servers
            prefix = [rng.randrange(500) for _ in range(args.shared_prefix)]
            specs = random_token_specs(4 * c, args.question_len, args.shared_output_len, 500, rng, model, prefix)
            processes = min(args.client_processes, c)
            results, wall, client_cpu = run_load_processes(url, specs, c, processes)
            summary = summarize(results, wall, c)
            summary["client_processes"] = processes
            summary["client_cpu_per_wall"] = round(client_cpu, 3)
            metrics = httpx.get(f"{url}/metrics").text
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        summary["prefix_cache_metrics"] = [
            ln for ln in metrics.splitlines() if "prefix_cache" in ln and not ln.startswith("#")
        ]
        print(name, json.dumps({k: summary[k] for k in ("output_tokens_per_s", "ttft_ms")}), flush=True)
        out[name] = summary
    out["ttft_p50_ratio"] = out["cache_on"]["ttft_ms"]["p50"] / out["cache_off"]["ttft_ms"]["p50"]
    print("TTFT p50 with / without the prefix cache:", round(out["ttft_p50_ratio"], 3), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/q8b"))
    parser.add_argument("--concurrency", default="1,8,32,64,128")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="Also run the shared-prefix workload: an N-token common prefix + --question-len unique tokens, "
        "--shared-output-len generated, at --shared-concurrency clients, with the prefix cache on and off.",
    )
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--shared-output-len", type=int, default=64)
    parser.add_argument("--shared-concurrency", type=int, default=32)
    parser.add_argument("--skip-levels", action="store_true", help="Only the shared-prefix workload.")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=4,
        metavar="N",
        help="Client processes the load comes from, the levels' and the shared-prefix workload's (default 4; "
        "at most C): one Python process reading 128 streams spends ~0.9 of a core and would set the pace itself.",
    )
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="An extra `qruntime serve` argument (repeat for more)."
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = gpu_report_header("serve_bench", synthetic=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    timings: dict = {}
    art, _ = build_artifact(args.preset, args.workdir, timings)
    print("built", timings, flush=True)
    runs, metrics = ([], "") if args.skip_levels else levels_run(art, levels, args)
    shared = shared_prefix_runs(art, args) if args.shared_prefix else None
    report.update(
        preset=args.preset,
        recipe="ptpc-fp8 (tuned)",
        serve_args=args.serve_arg,
        shared_prefix_workload=None
        if not args.shared_prefix
        else {
            "prefix_len": args.shared_prefix,
            "question_len": args.question_len,
            "output_len": args.shared_output_len,
            "concurrency": args.shared_concurrency,
            "requests": 4 * args.shared_concurrency,
        },
        input_len=args.input_len,
        output_len=args.output_len,
        timings=timings,
        levels=runs,
        shared_prefix=shared,
        server_metrics_after=[line for line in metrics.splitlines() if line and not line.startswith("#")][:40],
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    os.sync()


if __name__ == "__main__":
    main()
