"""Compile memory at full model scale, without the disk a random checkpoint of that size needs.

Writes a *sparse* checkpoint for a preset: real config.json, tokenizer and safetensors headers,
tensor data left as file holes (all-zero weights, taking no disk space), then runs the real
`qcompile compile` on it under `/usr/bin/time -v`. All-zero weights cost the same to stream and
quantize as random ones (every byte is read, reduced, divided and written); only the output,
which is real data, needs disk. `--dry-run` stops after validation and planning (the graph with
every pass), which is what a 470 GB checkpoint allows on a small disk.

    python bench/scale_bench.py --preset qwen3-30b-a3b --workdir /tmp/qscale
    python bench/scale_bench.py --preset qwen3-235b-a22b --dry-run

Results go to bench/results/scale_bench_<preset>[_dry_run].json; the sparse checkpoint is labelled
as such in the JSON and deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

from compile_bench import report_header, timed

from qcompile.synth.sparse import write_sparse_checkpoint

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qcompile-scale"))
    parser.add_argument("--dry-run", action="store_true", help="validate and plan only (no output written)")
    parser.add_argument("--recipe", default="ptpc-fp8")
    args = parser.parse_args()

    shutil.rmtree(args.workdir, ignore_errors=True)
    ckpt = args.workdir / f"{args.preset}-sparse"
    apparent = write_sparse_checkpoint(args.preset, ckpt)
    out = args.workdir / "artifact"
    cmd = ["qcompile", "compile", str(ckpt), "-o", str(out), "-q", "--recipe", args.recipe]
    if args.dry_run:
        cmd.append("--dry-run")
    try:
        result = timed(cmd, args.workdir / "compile.log")
        artifact_bytes = None if args.dry_run else sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        verified = None
        if not args.dry_run:
            verified = subprocess.run(["qcompile", "verify", str(out), "-q"], capture_output=True).returncode == 0
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)

    report = {
        **report_header("scale_bench"),
        "preset": args.preset,
        "recipe": args.recipe,
        "checkpoint": "sparse: real config, tokenizer and headers; all-zero tensor data stored as file holes",
        "checkpoint_apparent_bytes": apparent,
        "mode": "dry-run (validate + plan + passes)" if args.dry_run else "full compile",
        "qcompile compile": result,
        "artifact_bytes": artifact_bytes,
        "artifact_verifies": verified,
        "target": {"peak_rss_gib_max": 1.0},
    }
    name = f"scale_bench_{args.preset}{'_dry_run' if args.dry_run else ''}.json"
    (HERE / "results" / name).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
