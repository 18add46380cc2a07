"""Issue-22 / issue-20 benchmark: decode TPOT and where a decode step's time goes, per batch size, at
tp = 1 and tp > 1 and per recipe (ptpc-fp8, w4a16, ...), on a SYNTHETIC artifact (`qcompile synth
PRESET --artifact --tp TP`, compiled with RECIPE, tuned for the batches measured).

Each `PRESET:TP[:RECIPE]` of --runs (ptpc-fp8 by default) runs in its own process (a tp engine owns
every GPU it uses): build and tune the artifact, load it, then per batch of --batches the TPOT of
--output-len greedy tokens after --input-len (prompts warmed into the prefix cache first, so TPOT is
the decode steps alone), and the captured decode graph's kernels by name (rank 0's,
decode_bench.decode_profile(graphs=True); not with --no-profile).
--no-pdl loads without programmatic dependent launch, so each kernel's time is its own, not its span
including the wait for the kernel before it.

    python bench/tp_decode_profile.py --runs qwen3-8b:1,qwen3-8b:2 --batches 1,64 --out tp_profile.json
    python bench/tp_decode_profile.py --runs qwen3-8b:1,qwen3-8b:1:w4a16 --batches 1,16 --no-profile
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path

import qruntime
import torch

sys.path.insert(0, str(Path(__file__).parent))

from compile_bench import gpu_report_header
from decode_bench import decode_profile
from qruntime.benchmark import measure

from qcompile.recipe.schema import load_recipe
from qcompile.synth.artifact import write_synthetic_artifact


def run_one(preset: str, tp: int, recipe: str, args) -> dict:
    from qcompile.tune.artifact import tune_artifact

    batches = [int(b) for b in args.batches.split(",")]
    art = args.workdir / f"{preset}-tp{tp}-{recipe}"
    shutil.rmtree(art, ignore_errors=True)
    write_synthetic_artifact(preset, art, load_recipe(recipe), tp=tp, progress=False)
    tune_artifact(art, buckets=tuple(sorted({1, *batches})))
    gc.collect()
    torch.cuda.empty_cache()
    row: dict = {"preset": preset, "tp": tp, "recipe": recipe, "pdl": not args.no_pdl, "batches": []}
    try:
        with qruntime.load(art, graph_capture="load", device="cuda", tp=tp, max_model_len=args.input_len + args.output_len + 256,
            max_num_seqs=max(batches), kv_cache_memory=8 << 30, pdl=False if args.no_pdl else None,
        ) as engine:  # fmt: skip
            row["engine"] = engine.description
            measure(engine, 64, 8, 1, seed=1)  # warm-up: kernels compile
            for batch in batches:
                measure(engine, args.input_len, 8, batch, seed=3)  # the prompts into the prefix cache
                timed = measure(engine, args.input_len, args.output_len, batch, seed=3)
                entry = {"batch": batch, "tpot_ms": timed["tpot_ms"]}
                print(f"{preset} tp={tp} {recipe} batch={batch}: TPOT {timed['tpot_ms']:.3f} ms", flush=True)
                if not args.no_profile:
                    entry["profile"] = decode_profile(
                        engine, context=args.input_len, steps=8, top=args.top, graphs=True, batch=batch
                    )
                    for r in entry["profile"]:
                        print("   ", json.dumps(r), flush=True)
                row["batches"].append(entry)
    finally:
        shutil.rmtree(art, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--runs", default="qwen3-8b:1,qwen3-8b:2", help="comma-separated PRESET:TP[:RECIPE] (RECIPE: ptpc-fp8)"
    )
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--top", type=int, default=16, help="kernels listed per profile")
    parser.add_argument("--no-pdl", action="store_true", help="load without programmatic dependent launch")
    parser.add_argument("--no-profile", action="store_true", help="TPOT only, no kernel profile")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qtpprof"))
    parser.add_argument("--run-timeout", type=float, default=240)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: the child of one run
    parser.add_argument("--row-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.one is not None:
        preset, tp, recipe = (*args.one.split(":"), "ptpc-fp8")[:3]
        args.row_out.write_text(json.dumps(run_one(preset, int(tp), recipe, args), indent=1) + "\n")
        return
    report = gpu_report_header("tp_decode_profile", synthetic=True)
    report["machine"]["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    report["runs"] = []
    passed = [
        "--batches", args.batches, "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--top", str(args.top), "--workdir", str(args.workdir), *(["--no-pdl"] if args.no_pdl else []),
        *(["--no-profile"] if args.no_profile else []),
    ]  # fmt: skip
    for item in args.runs.split(","):
        row_out = args.workdir / f"{item.replace(':', '_')}.json"
        row_out.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, *passed, "--one", item, "--row-out", str(row_out)]
        try:
            subprocess.run(cmd, check=True, timeout=args.run_timeout)
            report["runs"].append(json.loads(row_out.read_text()))
        except (subprocess.SubprocessError, OSError, ValueError) as exc:
            print(f"{item}: FAILED ({exc})", flush=True)
            report["runs"].append({"run": item, "error": f"{type(exc).__name__}: {exc}"})
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'run':>24} {'batch':>5} {'TPOT ms':>8} {'kernel us':>9} {'kernels':>7}")
    for r in report["runs"]:
        for b in r.get("batches", []):
            total = b["profile"][-1] if "profile" in b else {"us_per_step": float("nan"), "calls_per_step": 0}
            run = f"{r['preset']}:{r['tp']}:{r['recipe']}"
            print(
                f"{run:>24} {b['batch']:>5} {b['tpot_ms']:>8.3f} {total['us_per_step']:>9.1f} "
                f"{total['calls_per_step']:>7.0f}"
            )


if __name__ == "__main__":
    main()
