"""Issue-19 profile: where a speculating engine's step goes, against plain decoding of the same artifact.

One SYNTHETIC artifact (`qcompile synth PRESET --artifact`, random weights made at load; RECIPE,
untuned) and prompts that repeat a random phrase (the greedy output of random weights soon cycles,
so prompt lookup finds its drafts: acceptance here says nothing about a real model, the step costs
do). For each mode (plain, then each --methods entry), at each batch of --batches: one engine, warmed
up on the same prompts, then one timed generate() of --max-tokens tokens a prompt (EOS ignored), with
timers wrapped (at class level) around the parts of a step:

    step       Engine.step, the whole of it (host wall time)
    schedule   Scheduler.schedule (a speculating engine's drafting runs inside it: draft)
    draft      Speculator.draft and draft_ahead (prompt lookup's n-gram search, a draft model's steps)
    draft_ahead  Speculator.draft_ahead: a draft model's batched drafting, before the schedule
    execute    ModelRunner.execute (the draft model's steps too): its host time, and which path ran the step, each with its count and
               host ms: decode graph replay, mixed-step graph replay, piecewise graphs, eager plan
    sample     sample_on_device; verify: rejection.verify_drafts (queues the verdicts)
    complete   Engine._complete: reading the step's tokens (the wait for the GPU) and the update
    prepare    ModelRunner.prepare: a step's inputs built on the host and copied (not a decode graph's)
    run_nodes  Plan.run_nodes: eager ops (a mixed or piecewise graph's logits tail; an eager step)
    bounds_work  the attention work list a mixed graph's replay reads, built on the host
    chain      DecodeChains.run: a draft's greedy steps after the first, one graph replay (decode_chains.py)
    capture_mixed, capture_decode, capture_chain  graph captures during the timed run (first use)
    gpu        CUDA events around ModelRunner.execute: the forward's device span

    python bench/spec_step_profile.py --preset qwen3-0.6b --batches 1,8 --out bench/results/spec_step_profile.json

--artifact ART profiles a compiled artifact instead (a trained one: bench/spec_bench.py --train
--workdir DIR leaves DIR/target-ptpc-fp8 and DIR/draft-ptpc-fp8). --method SPEC (repeatable) takes
a speculative config whose options hold commas, e.g. 'draft-model:draft_model=DIR/draft-ptpc-fp8,
adaptive=false': with adaptive off every step drafts, so the parts are one verification round's.
--torch-profile N adds, per mode, a torch.profiler pass over N tokens a prompt: CUDA kernels and
their device time per step, and the host ops that launched most often (what a step's host time is).

CPU: `--device cpu --preset tiny` runs the same path (the reference ops: host figures only).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import qruntime  # noqa: E402
from compile_bench import bench_artifact, gpu_report_header, report_header  # noqa: E402
from qruntime import SamplingParams, SpeculativeConfig  # noqa: E402
from qruntime.engine import engine as engine_module  # noqa: E402
from qruntime.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from qruntime.engine.decode_chains import DecodeChains  # noqa: E402
from qruntime.engine.engine import Engine  # noqa: E402
from qruntime.engine.mixed_graphs import MixedGraphs  # noqa: E402
from qruntime.engine.model_runner import ModelRunner  # noqa: E402
from qruntime.engine.piecewise_graphs import PiecewiseGraphs  # noqa: E402
from qruntime.engine.scheduler import Scheduler  # noqa: E402
from qruntime.engine.speculative.speculator import Speculator  # noqa: E402
from qruntime.kernels import paged_prefill_attention  # noqa: E402
from qruntime.plan import Plan  # noqa: E402

PATHS = {"decode_graph": (DecodeGraphs, "run"), "mixed_graph": (MixedGraphs, "run"),
         "piecewise": (PiecewiseGraphs, "run"), "eager": (Plan, "run")}  # fmt: skip
PARTS = {"step": (Engine, "step"), "schedule": (Scheduler, "schedule"), "draft": (Speculator, "draft"),
         "draft_ahead": (Speculator, "draft_ahead"), "execute": (ModelRunner, "execute"),
         "complete": (Engine, "_complete"), "prepare": (ModelRunner, "prepare"), "run_nodes": (Plan, "run_nodes"),
         "capture_mixed": (MixedGraphs, "capture"), "capture_decode": (DecodeGraphs, "capture"),
         "chain": (DecodeChains, "run"), "capture_chain": (DecodeChains, "capture")}  # fmt: skip
MODULE_PARTS = {"sample": "sample_on_device", "verify": "verify_drafts"}  # names in qruntime.engine.engine
OTHER_PARTS = {"bounds_work": (paged_prefill_attention, "bounds_work")}  # module functions looked up at each call


class Timers:
    """Host wall time and calls per part; the forward's CUDA events; the execute paths taken. Wrapping
    is at class (or module) level and undone by `restore`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host: dict[str, list[float]] = {}
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._undo: list[Callable[[], None]] = []
        self._depth = 0  # Plan.run inside a graph's eager tail is the graph's, not an eager step

    def _timed(self, name: str, fn: Callable[..., Any], gpu: bool = False, path: bool = False) -> Callable[..., Any]:
        timers = self

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if path and name == "eager" and timers._depth:
                return fn(*args, **kwargs)
            if path:
                timers._depth += 1
            if gpu and timers.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.host.setdefault(name, []).append(time.perf_counter() - t0)
                if path:
                    timers._depth -= 1
                if gpu and timers.device.type == "cuda":
                    end.record()
                    timers.events.append((start, end))

        return wrapper

    def install(self) -> None:
        for name, (cls, attr) in {**PARTS, **PATHS}.items():
            original = getattr(cls, attr)
            setattr(cls, attr, self._timed(name, original, gpu=name == "execute", path=name in PATHS))
            self._undo.append(functools.partial(setattr, cls, attr, original))
        modules = {name: (engine_module, attr) for name, attr in MODULE_PARTS.items()} | OTHER_PARTS
        for name, (module, attr) in modules.items():
            original = getattr(module, attr)
            setattr(module, attr, self._timed(name, original))
            self._undo.append(functools.partial(setattr, module, attr, original))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def report(self, steps: int) -> dict[str, Any]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out: dict[str, Any] = {}
        for name, times in sorted(self.host.items()):
            out[name] = {"calls": len(times), "ms_per_step": round(1e3 * sum(times) / max(steps, 1), 4)}
        if self.events:
            gpu = sum(s.elapsed_time(e) for s, e in self.events)
            out["gpu_forward"] = {"calls": len(self.events), "ms_per_step": round(gpu / max(steps, 1), 4)}
        return out


def _prompts(rng: random.Random, count: int, vocab: int, length: int) -> list[list[int]]:
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(100, vocab) for _ in range(rng.randrange(4, 12))]
        prompts.append((phrase * (length // len(phrase) + 1))[:length])
    return prompts


def kernel_profile(engine: Any, prompts: list[list[int]], tokens: int, device: str, top: int = 12) -> dict[str, Any]:
    """torch.profiler over one generate() of `tokens` tokens a prompt: per engine step, the CUDA kernels
    launched and their summed device time, and the `top` host ops by calls (with their host time)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    steps = 0
    step = Engine.step

    def counted(self: Engine) -> Any:
        nonlocal steps
        steps += 1
        return step(self)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    Engine.step = counted  # type: ignore[method-assign]
    try:
        with profile(activities=activities) as prof:
            engine.generate(prompts, params)
            if device == "cuda":
                torch.cuda.synchronize()
    finally:
        Engine.step = step  # type: ignore[method-assign]
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    ops: dict[str, list[float]] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(("aten::", "cuda", "triton")):
            ops.setdefault(e.name, []).append(e.cpu_time_total)
    ranked = sorted(ops.items(), key=lambda item: -len(item[1]))[:top]
    per = max(steps, 1)
    return {
        "tokens_per_prompt": tokens,
        "steps": steps,
        "kernels_per_step": round(len(kernels) / per, 1),
        "kernel_ms_per_step": round(sum(e.device_time_total for e in kernels) / 1e3 / per, 4),
        "host_ops": {
            name: {"calls_per_step": round(len(t) / per, 2), "us_per_step": round(sum(t) / per, 1)}
            for name, t in ranked
        },  # fmt: skip
    }


def run_mode(art: Path, mode: str, batch: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    spec = None if mode == "plain" else SpeculativeConfig.parse(mode)
    extra = {"dtype": torch.float32} if args.device == "cpu" else {"kv_cache_memory": args.kv_cache_gib << 30}
    engine = qruntime.load(art, graph_capture="load", device=args.device, speculative=spec, **extra)
    try:
        vocab = engine.tokenizer.vocab_size if hasattr(engine.tokenizer, "vocab_size") else 1000
        prompts = _prompts(random.Random(seed), batch, min(vocab, 20000), args.input_len)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        engine.generate(prompts, params)  # warm-up: compiles, captures, prefix-caches the prompts
        timers = Timers(torch.device(args.device))
        timers.install()
        try:
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            if args.device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        finally:
            timers.restore()
        tokens = sum(len(o.token_ids) for o in outs)
        steps = len(timers.host.get("step", []))
        speculator = getattr(engine, "speculator", None)
        stats = speculator.stats if speculator is not None else None
        row = {
            "mode": mode,
            "batch": batch,
            "tokens": tokens,
            "steps": steps,
            "wall_s": round(wall, 4),
            "ms_per_token_per_request": round(1e3 * wall * batch / max(tokens, 1), 4),
            "output_tokens_per_s": round(tokens / wall, 1),
            "parts": timers.report(steps),
        }
        if args.torch_profile:
            row["torch_profile"] = kernel_profile(engine, prompts, args.torch_profile, args.device)
        if stats is not None:
            row["speculative"] = {
                "acceptance_rate": round(stats.acceptance_rate, 4),
                "tokens_per_verification": round(stats.tokens_per_verification, 3),
                "verifications": stats.verifications,
            }
        return row
    finally:
        engine.close()
        del engine
        gc.collect()  # the next mode's engine sizes nothing from this one's memory
        if args.device == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--recipe", default="ptpc-fp8")
    parser.add_argument(
        "--artifact", type=Path, default=None, help="a compiled artifact instead of --preset's synthetic one"
    )
    parser.add_argument("--methods", default="prompt-lookup", help="comma-separated speculative configs ('' for none)")
    parser.add_argument(
        "--method", action="append", default=[], help="one speculative config (repeatable; may hold commas)"
    )
    parser.add_argument(
        "--torch-profile", type=int, default=0, metavar="N", help="kernels and host ops over N tokens a prompt"
    )
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kv-cache-gib", type=int, default=8, help="each engine's KV cache (and a draft model's)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qspecprof"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    art = bench_artifact(parser, args.artifact, args.preset, args.recipe, args.workdir)
    report = (
        gpu_report_header("spec_step_profile", synthetic=args.artifact is None)
        if args.device == "cuda"
        else report_header("spec_step_profile")
    )
    source = {"artifact": str(art)} if args.artifact is not None else {"preset": args.preset, "recipe": args.recipe}
    report |= source | {"seed": seed, "rows": []}
    methods = [m for m in args.methods.split(",") if m.strip()] + args.method
    print(
        f"{'mode':>16} {'batch':>5} {'ms/tok':>7} {'steps':>5} {'accept':>6}  step | schedule draft draft_ahead chain execute sample verify complete gpu (ms per step); paths"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        for mode in ("plain", *methods):
            row = run_mode(art, mode, batch, args, seed)
            report["rows"].append(row)
            p = row["parts"]
            ms = {
                k: p.get(k, {}).get("ms_per_step", 0.0)
                for k in (
                    "step",
                    "schedule",
                    "draft",
                    "draft_ahead",
                    "chain",
                    "execute",
                    "sample",
                    "verify",
                    "complete",
                    "gpu_forward",
                )
            }
            paths = {k: p[k]["calls"] for k in PATHS if k in p}
            acc = row.get("speculative", {}).get("acceptance_rate", float("nan"))
            print(f"{mode[:40]:>16} {batch:>5} {row['ms_per_token_per_request']:>7.3f} {row['steps']:>5} {acc:>6.2f}  "
                  + " ".join(f"{v:.3f}" for v in ms.values()) + f"; {paths}", flush=True)  # fmt: skip
            fine = (
                "decode_graph",
                "mixed_graph",
                "prepare",
                "run_nodes",
                "bounds_work",
                "capture_mixed",
                "capture_decode",
            )
            per_call = {k: 1e3 * p[k]["ms_per_step"] * row["steps"] / 1e3 / p[k]["calls"] for k in fine if k in p}
            print(
                f"{'':>16} host ms a call: " + ", ".join(f"{k} {v:.3f} ({p[k]['calls']})" for k, v in per_call.items())
            )
            if "torch_profile" in row:
                tp = row["torch_profile"]
                ops = ", ".join(f"{n} {o['calls_per_step']}" for n, o in list(tp["host_ops"].items())[:8])
                print(f"{'':>16} kernels/step {tp['kernels_per_step']}, kernel ms/step {tp['kernel_ms_per_step']}; "
                      f"host ops/step: {ops}", flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
