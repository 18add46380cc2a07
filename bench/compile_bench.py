"""Compile cost: qcompile vs llm-compressor `oneshot` and `model_free_ptq`, in one run.

Synthesizes a checkpoint (default: qwen3-1.7b shapes, random bf16 weights), then runs each tool
in its own process under `/usr/bin/time -v` and records wall time and peak RSS. It also checks
that qcompile's weights (split back to source names) equal model_free_ptq's byte for byte.

    python bench/compile_bench.py --preset qwen3-1.7b --workdir /tmp/qbench

Writes bench/results/compile_bench_<preset>.json with the machine, versions, date and command.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent

ONESHOT = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    src, out = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC",
            ignore=["lm_head", "re:.*mlp.gate$"]))
    model.save_pretrained(out, save_compressed=True)
    """
)

MODEL_FREE = textwrap.dedent(
    """
    import sys
    from llmcompressor import model_free_ptq
    src, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model_free_ptq(src, out, scheme="FP8_DYNAMIC", ignore=["lm_head", "re:.*mlp.gate$", "model.embed_tokens"],
                   max_workers=workers, device="cpu")
    """
)


def timed(cmd: list[str], log: Path) -> dict[str, float]:
    """Run `cmd` under /usr/bin/time -v; return wall seconds and peak RSS in GiB."""
    with open(log, "w") as handle:
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=handle, stderr=subprocess.STDOUT)
    text = log.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed (exit {proc.returncode}); see {log}:\n{text[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text).group(1)
    seconds = 0.0
    for part in wall.split(":"):
        seconds = seconds * 60 + float(part)
    return {"wall_s": round(seconds, 2), "peak_rss_gib": round(rss_kb / 2**20, 3)}


def compare_bytes(ours: Path, reference: Path) -> dict[str, int]:
    """Every tensor of the model_free_ptq output vs qcompile's split back to source names."""
    import torch
    from safetensors import safe_open

    from qcompile.publish.unfuse import split_to_sources

    ref: dict[str, object] = {}
    for file in sorted(reference.glob("*.safetensors")):
        handle = safe_open(str(file), framework="pt")
        for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
            ref[key] = (handle, key)
    compared = mismatched = 0
    for name, weight, scale in split_to_sources(ours):
        pairs = [(name, weight)] + ([(name + "_scale", scale)] if scale is not None else [])
        for key, tensor in pairs:
            handle, k = ref.pop(key)
            other = handle.get_tensor(k)
            same = other.shape == tensor.shape and torch.equal(
                other.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)
            )
            compared += 1
            mismatched += not same
    return {"tensors_compared": compared, "mismatched": mismatched, "reference_only": len(ref)}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("qcompile", "torch", "transformers", "llmcompressor", "compressed-tensors", "safetensors"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def machine() -> dict[str, object]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "memory_gib": round(mem / 2**20, 1), "gpu": None}


def git_commit() -> str | None:
    """The commit the bench runs: QCOMPILE_GIT_COMMIT when set (a copied tree: the lent GPU machines get
    the working tree with a .git that need not be at its HEAD), else `git rev-parse HEAD` (+ "-dirty"
    when tracked files differ from it); None when neither is there."""
    if given := os.environ.get("QCOMPILE_GIT_COMMIT"):
        return given
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def report_header(benchmark: str) -> dict[str, object]:
    """What every committed bench JSON starts with: which bench, when, how it was run, at which commit, where."""
    return {
        "benchmark": benchmark,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "git_commit": git_commit(),
        "machine": machine(),
        "versions": versions(),
    }


SYNTHETIC_WEIGHTS = "synthetic: random bf16 weights of the preset's exact shapes (qcompile synth)"


def bench_artifact(
    parser: argparse.ArgumentParser, artifact: Path | None, preset: str, recipe: str, workdir: Path
) -> Path:
    """A bench's artifact: `artifact` when given (it must hold a manifest.json, else parser.error), or
    a synthetic one of `preset` compiled with `recipe`, written afresh to workdir/PRESET-RECIPE."""
    if artifact is not None:
        if not (artifact / "manifest.json").is_file():
            parser.error(f"--artifact {artifact}: no manifest.json there")
        return artifact
    from qcompile.recipe.schema import load_recipe
    from qcompile.synth.artifact import write_synthetic_artifact

    art = workdir / f"{preset}-{recipe}"
    shutil.rmtree(art, ignore_errors=True)
    write_synthetic_artifact(preset, art, load_recipe(recipe), tp=1, progress=False)
    return art


def gpu_report_header(benchmark: str, synthetic: bool = False) -> dict[str, object]:
    """report_header of a GPU run: the GPU, the torch and triton it ran with, and for `synthetic`
    runs what the weights are."""
    import torch
    import triton

    report = report_header(benchmark)
    report["machine"]["gpu"] = torch.cuda.get_device_name()
    report["versions"].update(torch=torch.__version__, triton=triton.__version__)
    if synthetic:
        report["weights"] = SYNTHETIC_WEIGHTS
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qcompile-bench"))
    parser.add_argument("--skip-oneshot", action="store_true", help="oneshot loads the whole model")
    parser.add_argument("--model-free-workers", type=int, default=2)
    parser.add_argument("--max-shard-mb", type=float, default=750, help="source shard size (anchor: 5 shards)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"{args.preset}-ckpt"
    if not (ckpt / "config.json").exists():
        subprocess.run(
            ["qcompile", "synth", args.preset, "-o", str(ckpt), "--force", "--max-shard-mb", str(args.max_shard_mb)],
            check=True,
        )
    source_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))

    results: dict[str, dict] = {}
    ours = work / "qcompile-out"
    results["qcompile compile"] = timed(
        ["qcompile", "compile", str(ckpt), "-o", str(ours), "--force", "-q"], work / "qcompile.log"
    )
    mf = work / "model-free-out"
    shutil.rmtree(mf, ignore_errors=True)
    results["llm-compressor model_free_ptq"] = timed(
        [sys.executable, "-c", MODEL_FREE, str(ckpt), str(mf), str(args.model_free_workers)], work / "model_free.log"
    )
    if not args.skip_oneshot:
        one = work / "oneshot-out"
        shutil.rmtree(one, ignore_errors=True)
        results["llm-compressor oneshot"] = timed(
            [sys.executable, "-c", ONESHOT, str(ckpt), str(one)], work / "oneshot.log"
        )
        shutil.rmtree(one, ignore_errors=True)
    parity = compare_bytes(ours, mf)
    shutil.rmtree(mf, ignore_errors=True)

    base = results.get("llm-compressor oneshot")
    ours_r = results["qcompile compile"]
    report = {
        **report_header("compile_bench"),
        "preset": args.preset,
        "source_bytes": source_bytes,
        "model_free_workers": args.model_free_workers,
        "results": results,
        "ratios": {
            "qcompile_wall_over_oneshot": round(ours_r["wall_s"] / base["wall_s"], 3) if base else None,
            "qcompile_wall_over_model_free": round(
                ours_r["wall_s"] / results["llm-compressor model_free_ptq"]["wall_s"], 3
            ),
        },
        "targets": {"peak_rss_gib_max": 1.0, "wall_over_oneshot_max": 0.5},
        "byte_identity_vs_model_free_ptq": parity,
    }
    out = args.out or HERE / "results" / f"compile_bench_{args.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
