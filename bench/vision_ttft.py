"""Issue-21 benchmark: time to first token of a Qwen3-VL prompt with one image, split into its parts,
against transformers on the same weights in the same run, and the vision encoder's images/s.

The model is a preset's shapes with random weights: `qcompile synth PRESET` writes a bf16 checkpoint,
compiled here with --recipe (ptpc-fp8); transformers' Qwen3VL(Moe)ForConditionalGeneration loads the
same checkpoint in bf16. (--sparse compiles `qcompile synth --artifact` instead, no disk for the
weights, random weights made at load; transformers then gets its own random weights of the same
shapes.) One random RGB image of --image-size² pixels and --text-tokens text tokens around
`<|vision_start|><|image_pad|><|vision_end|>`:

- preprocess: preprocess_images(..., device) (resize, normalize, patchify on the GPU);
- encoder: the artifact's vision graph (engine.vision.encoder) on those pixel values;
- engine: Engine.generate of the prompt (MultimodalPrompt: ids expanded, pixels on the device) for
  one token: the request's preparation (prepare: M-RoPE positions and the images' digest, timed
  alone too), the encoder again, then the prefill and the first token;
- prefill = engine - prepare - encoder; ttft = preprocess + engine;
- transformers: one forward over the same ids and pixel values (its encoder + prefill + logits);
- encoder images/s: --encoder-batch images in one encoder call (ours and transformers' tower).

Each part: --warmup untimed runs, then the median of --runs, each between device synchronizations.

    python bench/vision_ttft.py --preset qwen3-vl-8b --workdir /tmp/vl8b    # on a GPU
    python bench/vision_ttft.py --tiny --workdir /tmp/vl-tiny               # the CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import qruntime
import torch
from compile_bench import gpu_report_header, report_header
from PIL import Image
from qruntime.engine.sampling_params import SamplingParams
from qruntime.vision.preprocess import VisionPreprocessConfig, preprocess_images
from qruntime.vision.prompt_images import MultimodalPrompt

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe
from qcompile.synth import get_preset, write_checkpoint
from qcompile.synth.artifact import write_synthetic_artifact

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(preset="tiny-vl", image_size=48, text_tokens=8, runs=2, warmup=1, encoder_batch=2, device="cpu")


def build(args: argparse.Namespace, timings: dict[str, float]) -> tuple[Path, Path | None]:
    """(artifact, bf16 checkpoint or None with --sparse) under the workdir, reusing what is there."""
    work, preset = args.workdir, args.preset
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.sparse:
        art = work / f"{preset}-synthetic-{args.recipe}"
        if not (art / "manifest.json").exists():
            write_synthetic_artifact(preset, art, load_recipe(args.recipe), progress=False)
        timings["build_s"] = time.perf_counter() - start
        tune(art, args, timings)
        return art, None
    ckpt, art = work / preset, work / f"{preset}-{args.recipe}"
    if not (ckpt / "config.json").exists():
        write_checkpoint(preset, ckpt, seed=0)
    timings["synth_s"] = time.perf_counter() - start
    start = time.perf_counter()
    if not (art / "manifest.json").exists():
        compile_checkpoint(prepare(ckpt, load_recipe(args.recipe)), art, workers=args.workers, progress=False)
    timings["compile_s"] = time.perf_counter() - start
    tune(art, args, timings)
    return art, ckpt


def tune(art: Path, args: argparse.Namespace, timings: dict[str, float]) -> None:
    """`qcompile tune` of the artifact's GEMM shapes at --tune-buckets on this GPU (none: untuned)."""
    if not args.tune_buckets or args.device == "cpu":
        return
    from qcompile.tune.artifact import tune_artifact

    start = time.perf_counter()
    tune_artifact(art, buckets=[int(b) for b in args.tune_buckets.split(",")])
    timings["tune_s"] = time.perf_counter() - start


def median_ms(fn: Callable[[], Any], device: torch.device, runs: int, warmup: int) -> tuple[float, Any]:
    """Median wall time of fn() in ms over `runs` after `warmup`, synchronized before and after each
    call (the engine's step is host-driven: events would miss its host work); the last result."""
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(runs):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_image(size: int, rng: random.Random) -> Image.Image:
    pixels = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def prompt_ids(config: dict, text_tokens: int, image_tokens: int, rng: random.Random) -> list[int]:
    """text, vision_start, the image's tokens, vision_end, text: `text_tokens` ordinary ids in all."""
    trained = config["text_config"]["bos_token_id"]  # the synthetic tokenizer's ordinary ids are below it
    words = [rng.randrange(trained) for _ in range(text_tokens)]
    half = text_tokens // 2
    image = [config["vision_start_token_id"], *[config["image_token_id"]] * image_tokens, config["vision_end_token_id"]]
    return words[:half] + image + words[half:]


def transformers_model(ckpt: Path | None, config: dict, device: torch.device, dtype: torch.dtype):
    """transformers' model of the checkpoint (or, with --sparse, of the config with random weights)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    if ckpt is not None:
        where = {"device_map": str(device)} if device.type == "cuda" else {}
        return AutoModelForImageTextToText.from_pretrained(ckpt, dtype=dtype, **where).to(device).eval()
    hf_config = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device(device):
        return AutoModelForImageTextToText.from_config(hf_config, dtype=dtype).eval()


def measure(args: argparse.Namespace, art: Path, ckpt: Path | None, report: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rng = random.Random(args.seed)
    preset = get_preset(args.preset)
    config, pre = preset.config(), VisionPreprocessConfig.from_dict(preset.preprocessor())
    image = random_image(args.image_size, rng)
    runs, warmup = args.runs, args.warmup
    results: dict[str, Any] = {}
    # the cache sized here, not from free memory: the default (all but 10% of the GPU) left too little
    # for the mixed graphs of 8192-token steps on an 80 GB H100 (out of memory in their capture)
    kv_memory = dict(kv_cache_memory=args.kv_cache_gib << 30) if device != "cpu" else {}
    with qruntime.load(
        art,
        graph_capture="load",
        device=device,
        dtype=dtype,
        prefix_cache=False,
        max_num_batched_tokens=args.max_batched_tokens,
        **kv_memory,
    ) as engine:
        report["engine"] = engine.description if hasattr(engine, "description") else None
        encoder = engine.vision.encoder
        results["preprocess_ms"], vision = median_ms(
            lambda: preprocess_images([image], pre, device=device), device, runs, warmup
        )
        image_tokens = int(vision.image_grid_thw.prod()) // pre.merge_size**2
        results["image_tokens"] = image_tokens
        results["encoder_ms"], _ = median_ms(
            lambda: encoder(vision.pixel_values, vision.image_grid_thw), device, runs, warmup
        )
        ids = prompt_ids(config, args.text_tokens, image_tokens, rng)
        results["prompt_tokens"] = len(ids)
        prompt = MultimodalPrompt(ids, vision, (), ())
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        # the request's preparation (M-RoPE positions; the images' digest for the prefix cache, on
        # the host) on its own: a PreparedPrompt keeps its embeddings once encoded, so it is not reused
        results["prepare_ms"], _ = median_ms(lambda: engine._prepare(prompt), device, runs, warmup)
        results["engine_ms"], outputs = median_ms(lambda: engine.generate(prompt, params), device, runs, warmup)
        results["first_token"] = int(outputs[0].token_ids[0])
        results["prefill_ms"] = results["engine_ms"] - results["prepare_ms"] - results["encoder_ms"]
        results["ttft_ms"] = results["preprocess_ms"] + results["engine_ms"]
        batch = preprocess_images(
            [random_image(args.image_size, rng) for _ in range(args.encoder_batch)], pre, device=device
        )
        batch_ms, _ = median_ms(lambda: encoder(batch.pixel_values, batch.image_grid_thw), device, runs, warmup)
        results["encoder_batch_ms"] = batch_ms
        results["encoder_images_per_s"] = args.encoder_batch / batch_ms * 1e3
    if not args.skip_transformers:
        if device.type == "cuda":  # the engine's weights and KV pool back before transformers loads
            gc.collect()
            torch.cuda.empty_cache()
        results["transformers"] = measure_transformers(args, ckpt, config, ids, vision, batch, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf = results["transformers"]
        results["speedup_ttft"] = hf["forward_ms"] / results["engine_ms"]
        results["speedup_encoder_images_per_s"] = results["encoder_images_per_s"] / hf["encoder_images_per_s"]
    return results


def measure_transformers(args, ckpt, config, ids, vision, batch, device) -> dict[str, Any]:
    """transformers bf16 (fp32 on CPU) on the same ids and pixel values: its first forward (encoder,
    prefill, logits) and its tower alone on the encoder batch."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = transformers_model(ckpt, config, device, dtype)
    input_ids = torch.tensor([ids], device=device)
    inputs = dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        pixel_values=vision.pixel_values.to(device, dtype),
        image_grid_thw=vision.image_grid_thw.to(device),
        mm_token_type_ids=(input_ids == config["image_token_id"]).to(torch.int32),
    )
    out: dict[str, Any] = {"weights": "the same bf16 checkpoint" if ckpt is not None else "random (from_config)"}
    with torch.inference_mode():
        out["forward_ms"], logits = median_ms(lambda: model(**inputs).logits, device, args.runs, args.warmup)
        out["first_token"] = int(logits[0, -1].argmax())
        pixels, grid = batch.pixel_values.to(device, dtype), batch.image_grid_thw.to(device)
        visual = model.model.visual
        out["encoder_batch_ms"], _ = median_ms(lambda: visual(pixels, grid_thw=grid), device, args.runs, args.warmup)
    out["encoder_images_per_s"] = args.encoder_batch / out["encoder_batch_ms"] * 1e3
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-vl-8b")
    parser.add_argument("--tiny", action="store_true", help=f"the CPU smoke run: {TINY}")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qcompile-vision-ttft"))
    parser.add_argument("--recipe", default="ptpc-fp8")
    parser.add_argument("--sparse", action="store_true", help="compile `qcompile synth --artifact` (no weight disk)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--image-size", type=int, default=1024)
    parser.add_argument("--text-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--encoder-batch", type=int, default=16)
    parser.add_argument("--max-batched-tokens", type=int, default=8192, help="the prompt prefills in one step")
    parser.add_argument("--kv-cache-gib", type=int, default=8, help="the engine's KV cache on a GPU")
    parser.add_argument(
        "--tune-buckets", default="", help="token buckets to tune the GEMMs at first, e.g. 1,2048 ('': untuned)"
    )
    parser.add_argument("--workers", type=int, default=16, help="compile workers")
    parser.add_argument("--seed", type=int, default=0, help="the image and text ids")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or []) if a.startswith("--")}
        for key, value in TINY.items():
            if key not in given:
                setattr(args, key, value)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    report = gpu_report_header("vision_ttft", synthetic=True) if on_gpu else report_header("vision_ttft")
    report["device"] = torch.cuda.get_device_name() if on_gpu else "cpu"
    if not on_gpu:
        report["note"] = "CPU smoke run (--tiny): checks the script, not a measurement"
    report["settings"] = {
        k: getattr(args, k)
        for k in (
            "preset",
            "recipe",
            "sparse",
            "image_size",
            "text_tokens",
            "runs",
            "warmup",
            "encoder_batch",
            "seed",
            "kv_cache_gib",
            "tune_buckets",
        )
    }
    timings: dict[str, float] = {}
    art, ckpt = build(args, timings)
    report["build"] = timings
    report["artifact"] = str(art)
    report["results"] = results = measure(args, art, ckpt, report)
    print(json.dumps(results, indent=1))
    out = args.out or ROOT / "bench" / "results" / f"vision_ttft_{args.preset}_{_device_tag(report['device'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return report


def _device_tag(device: str) -> str:
    words = [w.lower() for w in device.replace("-", " ").split() if any(c.isdigit() for c in w)]
    return words[0] if words and device != "cpu" else device.lower().replace(" ", "_")


if __name__ == "__main__":
    main()
