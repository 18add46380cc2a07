"""Issue-17 A/B of how the decode step's kernels are launched, in one process on one GPU, on a
SYNTHETIC tuned artifact per preset (`qcompile synth PRESET --artifact`, tuned at the measured
batch sizes):

  plain     every kernel waits for the one before it to finish before it launches
  pdl       programmatic dependent launch (kernels/pdl.py): each kernel launches while the one
            before it runs, and waits for its inputs on the GPU
  prefetch  pdl, and each Triton GEMM program asks L2 for the first --prefetch-k bytes of its
            weight rows before it waits (what the runtime does)
  unfolded  prefetch, but every split-K GEMM launches its own reduction instead of handing its
            partials to the next kernel, and every MoE its combine (ops/triton_ops.fold_split_k_reductions)
  moe-combine  prefetch with the GEMMs' reductions folded but the MoEs' combines launched (the default)
  combine-folded  prefetch, and each MoE's combine added up by the norm after it (PAIR_ROWS_READERS)
  router-launched  prefetch, but the norm before each fused MoE launched (not fold_router_norm)
  quant-launched   prefetch, but o_proj's input quantized in its own launch (not fold_dynamic_quant)
All modes but `unfolded` fold the GEMMs' reductions.

Modes are loaded in turn, twice each (graphs are captured at load, so a mode is a fresh engine).
Each load reports: the engine's TPOT at each batch (128 prompt tokens, 128 generated; the prompts
run once before, so the timed run's prefill hits the prefix cache and TPOT is decode alone), the
batch-1 decode graph replayed back to back (no host work between), the kernels in that graph, and
whether its greedy tokens equal the first mode's (same logits expected: PDL only moves launches).

    python bench/launch_ab.py --presets qwen3-8b,qwen3-30b-a3b --out bench/results/launch_ab_h100.json
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
from pathlib import Path

import qruntime
import qruntime.ops.triton_ops as triton_ops
import torch
from qruntime.benchmark import measure

sys.path.insert(0, str(Path(__file__).parent))

from compile_bench import gpu_report_header

from qcompile.recipe.schema import load_recipe
from qcompile.synth.artifact import write_synthetic_artifact

MODES = (
    "plain", "pdl", "prefetch", "unfolded", "moe-combine", "combine-folded", "router-launched", "quant-launched",
)  # fmt: skip


def replay_ms(engine, batch: int, iters: int = 200) -> float:
    """ms per replay of the decode graph of `batch`, replayed back to back."""
    replay = engine.runner.decode_graphs.replay_of(batch)
    for _ in range(20):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_kernels(engine, batch: int, layers: int) -> dict:
    """Kernels per replay of the decode graph of `batch` and per decoder layer (profiler count)."""
    from torch.profiler import ProfilerActivity, profile

    replay = engine.runner.decode_graphs.replay_of(batch)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            replay()
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if e.device_time_total > 0) / 5
    return {"kernels_per_step": launches, "kernels_per_layer": round(launches / layers, 2)}


def graph_trace(engine, batch: int) -> list[list]:
    """One replay of the decode graph of `batch`, kernel by kernel in launch order: [name, start µs
    from the replay's first kernel, µs on the GPU] (profiler spans: with PDL a span includes its wait
    for the kernel before it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    replay = engine.runner.decode_graphs.replay_of(batch)
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.elapsed_us() > 0),
        key=lambda e: e.time_range.start,
    )
    first = kernels[0].time_range.start if kernels else 0
    return [[e.name[:48], round(e.time_range.start - first, 2), round(e.time_range.elapsed_us(), 2)] for e in kernels]


def layer_path(trace: list[list]) -> list[list]:
    """A middle decoder layer's kernels in a graph_trace, each with what it adds to the step: its end
    minus the end of the kernel before it (µs; with PDL the kernels overlap, so their spans do not
    say it). Layers are found by their one QK-norm launch; a layer starts at its input norm, two
    kernels before it. Empty for fewer than three layers."""
    anchors = [i for i, kernel in enumerate(trace) if "qknorm" in kernel[0]]
    if len(anchors) < 3:
        return []
    mid = len(anchors) // 2
    ends = [start + span for _, start, span in trace]
    return [[trace[i][0], round(ends[i] - ends[i - 1], 2)] for i in range(anchors[mid] - 2, anchors[mid + 1] - 2)]


def greedy_tokens(engine) -> list[list[int]]:
    prompts = [[(7 * i + 3 * j) % 5000 + 10 for j in range(40)] for i in range(3)]
    outs = engine.generate(prompts, qruntime.SamplingParams(max_tokens=24, ignore_eos=True))
    return [o.token_ids for o in outs]


def no_fold(plan) -> int:
    return 0


def overrides(mode: str, args) -> dict:
    """The triton_ops attributes a mode sets (each put back after its load)."""
    changed = {"PTPCLinear.prefetch_k": args.prefetch_k if mode not in ("plain", "pdl") else 0}
    changed.update(
        {
            "unfolded": {"fold_split_k_reductions": no_fold},
            "moe-combine": {"PAIR_ROWS_READERS": ()},
            "combine-folded": {"PAIR_ROWS_READERS": (triton_ops.AddRMSNorm, triton_ops.AddRMSNormQuant)},
            "router-launched": {"fold_router_norm": no_fold},
            "quant-launched": {"fold_dynamic_quant": no_fold},
        }.get(mode, {})
    )
    return changed


def set_attrs(values: dict) -> dict:
    """Set triton_ops' dotted attributes; returns what they were."""
    before = {}
    for name, value in values.items():
        *path, attr = name.split(".")
        owner = triton_ops
        for part in path:
            owner = getattr(owner, part)
        before[name] = getattr(owner, attr)
        setattr(owner, attr, value)
    return before


def run_mode(art: Path, mode: str, args, layers: int, reference: list | None) -> dict:
    saved = set_attrs(overrides(mode, args))
    try:
        load_kw = dict(device="cuda", max_model_len=1024, max_num_seqs=max(args.batches), kv_cache_memory=8 << 30)
        with qruntime.load(art, graph_capture="load", pdl=mode != "plain" and not args.no_pdl, **load_kw) as engine:
            row: dict = {"mode": mode, "pdl": engine.description.get("pdl")}
            tokens = greedy_tokens(engine)
            row["greedy_equal_to_first"] = None if reference is None else tokens == reference
            for batch in args.batches:
                measure(engine, 128, 8, batch, seed=batch)  # the prompts' KV into the prefix cache
                row[f"tpot_ms_b{batch}"] = round(measure(engine, 128, 128, batch, seed=batch)["tpot_ms"], 3)
            row["replay_ms_b1"] = round(replay_ms(engine, 1), 3)
            row.update(graph_kernels(engine, 1, layers))
            if args.trace:
                row["trace_b1"] = graph_trace(engine, 1)
                row["layer_path_b1"] = layer_path(row["trace_b1"])
    finally:
        set_attrs(saved)
    gc.collect()
    torch.cuda.empty_cache()
    return row, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="qwen3-8b")
    parser.add_argument("--batches", default="1,64", help="comma-separated batch sizes (1 is always measured)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--prefetch-k", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-pdl", action="store_true", help="every mode without PDL: a kernel's span is its own time")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="each row also lists one batch-1 replay kernel by kernel (trace_b1) and what each kernel of a middle "
        "layer adds to the step (layer_path_b1, printed)",
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qlaunch"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.batches = sorted({1, *(int(b) for b in args.batches.split(",") if b)})
    modes = [m for m in args.modes.split(",") if m]
    from qcompile.synth.presets import get_preset
    from qcompile.tune.artifact import tune_artifact

    report = gpu_report_header("launch_ab", synthetic=True)
    report.update(prefetch_k=args.prefetch_k, batches=args.batches, rows=[])
    for preset in args.presets.split(","):
        art = args.workdir / preset
        shutil.rmtree(art, ignore_errors=True)
        write_synthetic_artifact(preset, art, load_recipe("ptpc-fp8"), progress=False)
        tune_artifact(art, buckets=tuple(args.batches), record_builds=False)  # each mode launches its own kernels
        layers = get_preset(preset).config()["num_hidden_layers"]
        gc.collect()
        torch.cuda.empty_cache()
        reference = None
        for _ in range(args.repeats):
            for mode in modes:
                row, tokens = run_mode(art, mode, args, layers, reference)
                reference = tokens if reference is None else reference
                row["preset"] = preset
                report["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("trace_b1", "layer_path_b1")}), flush=True)
                for name, us in row.get("layer_path_b1", ()):
                    print(f"    {name[:40]:40s} {us:7.2f} us")
                if args.out is not None:  # after every row: a call cut short keeps what it measured
                    args.out.write_text(json.dumps(report, indent=None if args.trace else 1) + "\n")
        shutil.rmtree(art, ignore_errors=True)


if __name__ == "__main__":
    main()
