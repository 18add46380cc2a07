"""Issue-24 A/B: a cold start's imports and weight read under read-ahead variants (qruntime/read_ahead.py).

Each trial drops the page cache (--drop all: every clean page, as cold_start.py's cold rows, so
torch's own libraries are cold too; --drop artifact: the artifact's files only), then a fresh
process runs `import qruntime; qruntime.load(ART, prebuild_kernels=False)` and reports the load's
split (imports: torch and the engine; weights: the reader). Variants:

  none          no read-ahead (the reader alone, after the imports)
  threads=N     the read-ahead with N reading threads
  idle=N        N reading threads in the idle I/O class (read_ahead.IDLE_IO: served when no other
                read waits, by a scheduler that has classes; the report names the disk's scheduler)
  libs-first    8 threads that read torch's and the NVIDIA wheels' shared libraries before the weights

Trials run variant after variant, --repeats times, so a drift of the machine shows in every variant.

    python bench/read_ahead_ab.py --artifact ART --device cuda --out bench/results/read_ahead_ab_<commit>_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cold_start import drop_pages, io_scheduler
from compile_bench import gpu_report_header, report_header

VARIANTS = ("none", "threads=8", "threads=2", "idle=2", "idle=8", "libs-first")

CHILD = """
import glob, importlib.util, json, os, sys, time
from pathlib import Path
started = time.time()
import qruntime
import qruntime.read_ahead as read_ahead
art, device, variant = sys.argv[1], sys.argv[2], sys.argv[3]
if variant == "none":
    read_ahead.weight_files = lambda root, manifest=None: []
elif variant.startswith(("threads=", "idle=")):
    read_ahead.THREADS = int(variant.split("=", 1)[1])
    read_ahead.IDLE_IO = variant.startswith("idle=")
elif variant == "libs-first":
    site = Path(importlib.util.find_spec("torch").submodule_search_locations[0]).parent  # torch not imported
    libs = sorted(glob.glob(f"{site}/torch/lib/*.so*")) + sorted(glob.glob(f"{site}/nvidia/*/lib/*.so*"))
    extra = [read_ahead.WeightFile(Path(p), os.path.getsize(p)) for p in libs]
    weights = read_ahead.weight_files
    read_ahead.weight_files = lambda root, manifest=None: extra + weights(root, manifest)
    read_ahead.THREADS = 8
engine = qruntime.load(art, device=device, prebuild_kernels=False)
import torch
if device.startswith("cuda"):
    torch.cuda.synchronize()
print("READ_AHEAD " + json.dumps({"to_loaded_s": round(time.time() - started, 3), **engine.description["load_seconds"]}))
engine.close()
"""


def trial(art: Path, device: str, variant: str, drop: str) -> dict:
    drop_pages(art, drop)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(art), device, variant], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("READ_AHEAD ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"variant {variant} failed:\n{proc.stderr[-3000:]}")
    return {"variant": variant, **json.loads(lines[-1].removeprefix("READ_AHEAD "))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True, help="a compiled artifact (weights on disk)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--drop", choices=("all", "artifact"), default="all")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    for variant in variants:
        kind, _, count = variant.partition("=")
        if variant not in ("none", "libs-first") and not (
            kind in ("threads", "idle") and count.isdigit() and int(count) > 0
        ):
            parser.error(f"--variants: {variant!r} is none of none, threads=N, idle=N (N > 0), libs-first")
    report = gpu_report_header("read_ahead_ab") if args.device.startswith("cuda") else report_header("read_ahead_ab")
    size = sum(p.stat().st_size for p in (args.artifact / "weights").rglob("*.safetensors"))
    report.update(device=args.device, artifact=str(args.artifact), weight_bytes=size, drop=args.drop)
    report.update(io_scheduler=io_scheduler(args.artifact), trials=[])
    for repeat in range(args.repeats):
        for variant in variants:
            result = {"repeat": repeat, **trial(args.artifact, args.device, variant, args.drop)}
            report["trials"].append(result)
            print(json.dumps(result), flush=True)
            if args.out is not None:
                args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
