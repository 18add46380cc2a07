"""The runtime's torch reference path on a GPU: correctness against transformers there, and what
it costs before any fast kernel (the baseline the Triton path of the next milestone is measured from).

In one run: synthesize tiny dense/MoE checkpoints and qwen3-0.6b shapes (random weights), compile
them, then on CUDA check
  - bf16 artifacts vs transformers in fp32: max |logit diff| and 32 greedy tokens,
  - ptpc-fp8 artifacts: batch of prompts == each alone (greedy), every KV layout identical,
and time qwen3-0.6b ptpc-fp8 in bf16: TTFT of a 512-token prompt, TPOT at batch 1 and 8.

    python bench/runtime_reference_gpu.py --workdir /tmp/qref --out bench/results/runtime_reference_gpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import qruntime
import torch
from compile_bench import gpu_report_header
from qruntime import SamplingParams
from transformers import AutoModelForCausalLM

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe
from qcompile.synth import get_preset, write_checkpoint


def build(work: Path, preset: str, recipe: str, *overrides: str) -> tuple[Path, Path]:
    ckpt = work / preset
    if not (ckpt / "config.json").exists():
        write_checkpoint(get_preset(preset).config(), ckpt, seed=0)
    art = work / f"{preset}-{recipe}-{'-'.join(o.replace('=', '_') for o in overrides) or 'default'}"
    if not (art / "manifest.json").exists():
        compile_checkpoint(prepare(ckpt, load_recipe(recipe, list(overrides))), art, workers=8, progress=False)
    return ckpt, art


def prompts(vocab: int, count: int, longest: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(17, longest))] for _ in range(count)]


@torch.inference_mode()
def hf_parity(ckpt: Path, art: Path, rng: random.Random) -> dict:
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda().eval()
    engine = qruntime.load(art, device="cuda", dtype=torch.float32, num_kv_blocks=256)
    ids = prompts(engine.vocab_size, 1, 90, rng)[0]
    ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
    got = engine.score(ids)
    seq = list(ids)
    for _ in range(32):
        seq.append(int(hf(torch.tensor([seq], device="cuda")).logits[0, -1].argmax()))
    ours = engine.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0].token_ids
    return {
        "max_abs_logit_diff": float((got - ref).abs().max()),
        "max_abs_logit": float(ref.abs().max()),
        "greedy_32_equal": list(ours) == seq[len(ids) :],
    }


def batch_and_layouts(work: Path, preset: str, rng: random.Random) -> dict:
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    tokens = {}
    for layout in ("nhd", "hnd", "x-packed"):
        _, art = build(work, preset, "ptpc-fp8", f"kv_cache.layout={layout}")
        engine = qruntime.load(art, device="cuda", num_kv_blocks=512)
        batch = prompts(engine.vocab_size, 12, 90, random.Random(7))
        tokens[layout] = [o.token_ids for o in engine.generate(batch, sp)]
        if layout == "nhd":
            alone = [engine.generate([p], sp)[0].token_ids for p in batch]
            batch_equal = tokens["nhd"] == alone
    return {"batch_equals_alone": batch_equal, "layouts_identical": len({str(t) for t in tokens.values()}) == 1}


def timed_steps(engine, batch: list[list[int]], max_tokens: int) -> dict:
    torch.cuda.synchronize()
    outs = engine.generate(batch, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    ttft = max(o.timings.ttft for o in outs)
    tpot = sum(o.timings.tpot for o in outs) / len(outs)
    return {
        "ttft_ms": round(ttft * 1e3, 2),
        "tpot_ms": round(tpot * 1e3, 2),
        "tokens_per_s": round(len(batch) / tpot, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qref"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random()
    report = gpu_report_header("runtime_reference_gpu")
    checks = {}
    for preset in ("tiny", "tiny-tied", "tiny-odd", "tiny-moe", "qwen3-0.6b"):
        ckpt, art = build(args.workdir, preset, "bf16")
        checks[f"{preset} bf16 vs transformers fp32"] = hf_parity(ckpt, art, rng)
        print(preset, checks[f"{preset} bf16 vs transformers fp32"], flush=True)
    for preset in ("tiny", "tiny-moe"):
        checks[f"{preset} ptpc-fp8 batching/layouts"] = batch_and_layouts(args.workdir, preset, rng)
        print(preset, checks[f"{preset} ptpc-fp8 batching/layouts"], flush=True)
    report["checks"] = checks

    _, art = build(args.workdir, "qwen3-0.6b", "ptpc-fp8")
    engine = qruntime.load(art, device="cuda", max_model_len=4096)
    engine.generate([[1] * 64], SamplingParams(max_tokens=4))  # warm-up
    timing = {}
    for batch in (1, 8):
        start = time.perf_counter()
        timing[f"batch {batch}, prompt 512, 64 out"] = timed_steps(
            engine, [[rng.randrange(1000) for _ in range(512)] for _ in range(batch)], 64
        )
        timing[f"batch {batch}, prompt 512, 64 out"]["wall_s"] = round(time.perf_counter() - start, 2)
    report["qwen3-0.6b ptpc-fp8 bf16 reference path"] = timing
    report["engine"] = engine.description
    print(json.dumps(timing, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
