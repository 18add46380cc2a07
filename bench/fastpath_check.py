"""The GPU fast path against the reference path, kernel by kernel and end to end, in one run.

1. Every kernel check of bench/gpu_kernels/*.py at qwen3-8b shapes (error vs torch reference, µs).
2. End to end on qwen3-0.6b shapes (random weights): greedy tokens of the triton backend (CUDA
   graphs on) equal the reference backend's for a 32-token generation of the bf16 artifact, and the
   ptpc-fp8 artifact's logits stay within fp8 tolerance; CUDA-graph replay equals eager.

    python bench/fastpath_check.py --workdir /tmp/qfast --out bench/results/fastpath_check.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import traceback
from pathlib import Path

import qruntime
import torch
from compile_bench import report_header
from qruntime import SamplingParams

from qcompile.pipeline import compile_checkpoint, prepare
from qcompile.recipe import load_recipe
from qcompile.synth import get_preset, write_checkpoint

HERE = Path(__file__).resolve().parent
KERNEL_CHECKS = ("fp8_gemm", "quant", "qknorm_rope", "paged_attention")


def build(work: Path, preset: str, recipe: str) -> Path:
    ckpt = work / preset
    if not (ckpt / "config.json").exists():
        write_checkpoint(get_preset(preset).config(), ckpt, seed=0)
    art = work / f"{preset}-{recipe}"
    if not (art / "manifest.json").exists():
        compile_checkpoint(prepare(ckpt, load_recipe(recipe)), art, workers=16, progress=False)
    return art


def kernel_rows() -> dict[str, list[dict]]:
    sys.path.insert(0, str(HERE / "gpu_kernels"))
    rows = {}
    for name in KERNEL_CHECKS:
        try:
            rows[name] = importlib.import_module(name).run("cuda")
        except Exception:  # report and go on: one broken kernel must not hide the others' results
            rows[name] = [{"error": traceback.format_exc(limit=6)}]
        for row in rows[name]:
            print(name, row, flush=True)
    return rows


def sqnr_db(ref: torch.Tensor, other: torch.Tensor) -> float:
    noise = (ref.float() - other.float()).pow(2).mean()
    return float(10 * torch.log10(ref.float().pow(2).mean() / noise))


def end_to_end(work: Path) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(150000) for _ in range(rng.randrange(20, 300))] for _ in range(6)]
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    out = {}
    for recipe in ("bf16", "ptpc-fp8"):
        art = build(work, "qwen3-0.6b", recipe)
        ref = qruntime.load(art, device="cuda", backend="reference", kv_cache_memory=4 << 30, max_model_len=4096)
        ref_tokens = [o.token_ids for o in ref.generate(prompts, sp)]
        ref_logits = ref.score(prompts[0])
        del ref
        fast = qruntime.load(
            art, device="cuda", backend="triton", kv_cache_memory=4 << 30, max_model_len=4096, max_num_seqs=8
        )
        fast_tokens = [o.token_ids for o in fast.generate(prompts, sp)]
        eager = qruntime.load(
            art, device="cuda", backend="triton", cuda_graphs=False, kv_cache_memory=4 << 30, max_model_len=4096
        )
        eager_tokens = [o.token_ids for o in eager.generate(prompts, sp)]
        fast_logits = fast.score(prompts[0])
        out[recipe] = {
            "greedy_equal_reference": sum(a == b for a, b in zip(ref_tokens, fast_tokens, strict=True)),
            "prompts": len(prompts),
            "graph_equals_eager": sum(a == b for a, b in zip(eager_tokens, fast_tokens, strict=True)),
            "first_divergence": [
                next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                for a, b in zip(ref_tokens, fast_tokens, strict=True)
            ],
            "logits_sqnr_db_vs_reference": round(sqnr_db(ref_logits, fast_logits), 2),
            "cuda_graphs": fast.description.get("cuda_graphs"),
        }
        print(recipe, out[recipe], flush=True)
        del fast, eager
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qfast"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = report_header("fastpath_check")
    import triton

    report["machine"]["gpu"] = torch.cuda.get_device_name()
    report["versions"].update(torch=torch.__version__, triton=triton.__version__)
    if not args.skip_kernels:
        report["kernels"] = kernel_rows()
    try:
        report["end_to_end"] = end_to_end(args.workdir)
    except Exception:
        report["end_to_end"] = {"error": traceback.format_exc(limit=8)}
        print(report["end_to_end"]["error"], flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
