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

import onnx
import qruntime
import torch
from compile_bench import gpu_report_header
from qruntime import SamplingParams
from qruntime.benchmark import sqnr_db
from qruntime.engine.step_chunk import StepChunk
from qruntime.kernel_configs import load_kernel_table
from qruntime.kv_cache import KVCache
from qruntime.ops.base import OpEnv, StepContext
from qruntime.ops.registry import triton_ops
from qruntime.plan import Plan

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe
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


def _chunks(prompts: list[list[int]], decode: bool, block_size: int) -> list[StepChunk]:
    """A prefill of every prompt (decode=False) or one decode step after it, in disjoint blocks."""
    chunks, next_block = [], 1
    for prompt in prompts:
        blocks = -(-(len(prompt) + 1) // block_size)
        table = tuple(range(next_block, next_block + blocks))
        next_block += blocks
        if decode:  # the token after the prompt: its first token again
            chunks.append(StepChunk((prompt[0],), len(prompt), table))
        else:
            chunks.append(StepChunk(tuple(prompt), 0, table))
    return chunks


def node_isolation(art: Path, prompts: list[list[int]]) -> dict[str, dict]:
    """Each fast op fed the reference op's own inputs (same weights, same cache state) at real shapes,
    for a prefill and a decode step: the worst relative error of its outputs (and of the KV cache it
    wrote) per op type, in dB (10·log10 of noise power / signal power; bf16 rounding is about -50)."""
    ref = qruntime.load(art, device="cuda", backend="reference", kv_cache_memory=1 << 30, max_model_len=2048)
    runner = ref.runner
    spec = runner.kv_cache.spec
    graph = onnx.load(str(art / "graph.onnx"), load_external_data=False).graph
    kernels = load_kernel_table(art, torch.cuda.get_device_name())
    env_ = OpEnv(torch.bfloat16, runner.device, spec, kernels)
    fast = Plan.build(graph, runner.plan.weights, env_, triton_ops())
    cache = runner.kv_cache
    shadow = KVCache(spec, cache.k[0].shape[0], torch.bfloat16, runner.device)
    worst: dict[str, dict] = {}

    def note(op: str, what: str, ref_t: torch.Tensor, fast_t: torch.Tensor) -> None:
        noise = (ref_t.float() - fast_t.float()).pow(2).mean() / ref_t.float().pow(2).mean().clamp(min=1e-30)
        db = round(float(10 * torch.log10(noise.clamp(min=1e-30))), 1)
        row = worst.setdefault(op, {"worst_db": -300.0, "at": ""})
        if db > row["worst_db"]:
            row.update(worst_db=db, at=what)

    with torch.inference_mode():
        for phase, decode in (("prefill", False), ("decode", True)):
            feeds, meta = runner.prepare(_chunks(prompts, decode, spec.block_size))
            env = {**runner.plan.weights, **feeds, "": None}
            for node, fast_node in zip(runner.plan.nodes, fast.nodes, strict=True):
                kind = type(node.op).__name__
                writes_kv = "layer" in node.op.a
                if writes_kv:
                    for mine, theirs in ((shadow.k, cache.k), (shadow.v, cache.v)):
                        for dst, src in zip(mine, theirs, strict=True):
                            dst.copy_(src)
                args = [env[name] for name in node.inputs]
                ref_out = node.op(StepContext(cache, meta), *args)
                fast_out = fast_node.op(StepContext(shadow, meta), *args)
                ref_out = ref_out if isinstance(ref_out, tuple) else (ref_out,)
                fast_out = fast_out if isinstance(fast_out, tuple) else (fast_out,)
                for name, x, y in zip(node.outputs, ref_out, fast_out, strict=True):
                    if x.is_floating_point() and x.numel():
                        note(kind, f"{phase} {node.name} -> {name}", x, y)
                if writes_kv:
                    layer = node.op.a["layer"]
                    for which, mine, theirs in (("k", shadow.k, cache.k), ("v", shadow.v, cache.v)):
                        note(f"{kind} (cache)", f"{phase} layer {layer} {which}", theirs[layer], mine[layer])
                env.update(zip(node.outputs, ref_out, strict=True))
    del ref, fast, shadow
    torch.cuda.empty_cache()
    return worst


def truth_distance(art: Path, prompt: list[int]) -> dict[str, float]:
    """How far each bf16 path's logits are from the same artifact run in fp32 by the reference ops:
    the fast path should be as close to that truth as the bf16 reference path is."""
    engines = {
        "reference_fp32": dict(backend="reference", dtype=torch.float32),
        "reference_bf16": dict(backend="reference"),
        "triton_bf16": dict(backend="triton", cuda_graphs=False),
    }
    logits = {}
    for name, kwargs in engines.items():
        engine = qruntime.load(art, device="cuda", kv_cache_memory=1 << 30, max_model_len=2048, **kwargs)
        logits[name] = engine.score(prompt).float()
        del engine
        torch.cuda.empty_cache()
    truth = logits.pop("reference_fp32")
    return {f"{name}_sqnr_db_vs_fp32": round(sqnr_db(truth, x), 2) for name, x in logits.items()}


def end_to_end(work: Path) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(150000) for _ in range(rng.randrange(20, 300))] for _ in range(6)]
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    out = {}
    for recipe in ("bf16", "ptpc-fp8"):
        art = build(work, "qwen3-0.6b", recipe)
        out[f"{recipe}_ops"] = node_isolation(art, [prompts[0], prompts[1][:37], prompts[2] * 4])
        print(recipe, "ops", json.dumps(out[f"{recipe}_ops"], indent=0), flush=True)
        out[f"{recipe}_truth"] = truth_distance(art, prompts[0])
        print(recipe, out[f"{recipe}_truth"], flush=True)
        ref = qruntime.load(art, device="cuda", backend="reference", kv_cache_memory=4 << 30, max_model_len=4096)
        ref_tokens = [o.token_ids for o in ref.generate(prompts, sp)]
        ref_logits = ref.score(prompts[0])
        fast = qruntime.load(
            art, device="cuda", backend="triton", kv_cache_memory=4 << 30, max_model_len=4096, max_num_seqs=8
        )
        fast_tokens = [o.token_ids for o in fast.generate(prompts, sp)]
        eager = qruntime.load(
            art, device="cuda", backend="triton", cuda_graphs=False, kv_cache_memory=4 << 30, max_model_len=4096
        )
        eager_tokens = [o.token_ids for o in eager.generate(prompts, sp)]
        fast_logits = fast.score(prompts[0])
        gaps = []  # where the paths part: how far apart the two tokens are in the reference's logits
        for prompt, a, b in zip(prompts, ref_tokens, fast_tokens, strict=True):
            i = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            if i is not None:
                row = ref.score(list(prompt) + list(a[:i]))[-1].float()
                gaps.append(round(float((row[a[i]] - row[b[i]]) / row.std()), 4))
        out[recipe] = {
            "greedy_equal_reference": sum(a == b for a, b in zip(ref_tokens, fast_tokens, strict=True)),
            "prompts": len(prompts),
            "graph_equals_eager": sum(a == b for a, b in zip(eager_tokens, fast_tokens, strict=True)),
            "first_divergence": [
                next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                for a, b in zip(ref_tokens, fast_tokens, strict=True)
            ],
            "reference_logit_gap_at_divergence_in_std": gaps,
            "logits_sqnr_db_vs_reference": round(sqnr_db(ref_logits, fast_logits), 2),
            "cuda_graphs": fast.description.get("cuda_graphs"),
        }
        print(recipe, out[recipe], flush=True)
        del ref, fast, eager
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qfast"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = gpu_report_header("fastpath_check")
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
