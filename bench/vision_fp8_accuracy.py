"""The accuracy of recipe vision.scheme ptpc-fp8 (docs/vision.md, "FP8 tower"), on the CPU in fp32.

For each tiny random Qwen3-VL checkpoint (tests/qwen3_vl_checkpoints.py: dense and MoE, float32), four
artifacts: the text model unquantized (recipe bf16) or ptpc-fp8, each with the tower in the model
dtype (vision.scheme none) or FP8 (ptpc-fp8). Measured:
- the encoder's output on random images of several sizes, FP8 tower against model-dtype tower: SQNR
  (dB) and max relative error (max |diff| / max |ref|) of the image embeddings and of each DeepStack
  feature;
- the logits at every position of prompts with images (engine.score), against transformers' fp32
  forward on the same weights: SQNR (dB), per text scheme and tower scheme.

    python bench/vision_fp8_accuracy.py [--prompts 4] [--out bench/results/vision_fp8_accuracy.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import qruntime
import torch
from compile_bench import report_header
from PIL import Image
from qruntime.engine.multimodal import ImagePrompt
from qruntime.vision.encoder import load_vision_encoder
from qruntime.vision.preprocess import VisionPreprocessConfig, preprocess_images

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe

ROOT = Path(__file__).resolve().parents[1]
SIZES = ((40, 24), (33, 47), (16, 16), (48, 20))  # (width, height) of the images


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.double().pow(2).sum() / (x.double() - ref.double()).pow(2).sum()))


def max_rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max())


def images(rng: random.Random, sizes: Sequence[tuple[int, int]]) -> list[Image.Image]:
    gen = np.random.default_rng(rng.randrange(1 << 30))
    return [Image.fromarray(gen.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def measure_kind(kind: str, work: Path, rng: random.Random, prompts: int) -> dict[str, Any]:
    from qwen3_vl_checkpoints import END, IMAGE, PREPROCESSOR, START, VISION, write_checkpoint

    ckpt = work / f"{kind}-ckpt"
    model = write_checkpoint(ckpt, kind)
    arts = {}
    for text in ("bf16", "ptpc-fp8"):
        for tower in ("none", "ptpc-fp8"):
            out = work / f"{kind}-{text}-{tower}"
            recipe = load_recipe(text, [f"vision.scheme={tower}"])
            compile_checkpoint(prepare(ckpt, recipe, tokenizer=False), out, workers=1, progress=False)
            arts[text, tower] = out
    pre = VisionPreprocessConfig.from_dict(PREPROCESSOR)
    vision = preprocess_images(images(rng, SIZES), pre)
    embeds = {}
    for tower in ("none", "ptpc-fp8"):
        root = arts["bf16", tower]
        entry = json.loads((root / "manifest.json").read_text())["vision"]
        embeds[tower] = load_vision_encoder(root, entry, "cpu", torch.float32)(
            vision.pixel_values, vision.image_grid_thw
        )
    ref, out = embeds["none"], embeds["ptpc-fp8"]
    width = ref.shape[1] // (1 + len(VISION["deepstack_visual_indexes"]))
    parts = {}
    for k, cols in enumerate(torch.split(torch.arange(ref.shape[1]), width)):
        name = "embeddings" if k == 0 else f"deepstack_{k - 1}"
        parts[name] = {"sqnr_db": sqnr_db(out[:, cols], ref[:, cols]), "max_rel": max_rel(out[:, cols], ref[:, cols])}
    # prompts with 1 to 3 images, text around them; logits against transformers' fp32 forward
    cases = []
    for _ in range(prompts):
        n = rng.randint(1, 3)
        ids = [rng.randrange(IMAGE) for _ in range(rng.randint(1, 5))]
        for _ in range(n):
            ids += [START, IMAGE, END] + [rng.randrange(IMAGE) for _ in range(rng.randint(1, 4))]
        cases.append(ImagePrompt(ids, images(rng, rng.sample(SIZES, n))))
    expected = []
    for prompt in cases:
        v = preprocess_images(prompt.images, pre)
        counts = (v.image_grid_thw.prod(-1) // 4).tolist()
        full = []
        for token in prompt.prompt:
            full += [IMAGE] * counts.pop(0) if token == IMAGE else [token]
        ids = torch.tensor(full)[None]
        with torch.no_grad():
            expected.append(
                model(
                    input_ids=ids,
                    pixel_values=v.pixel_values,
                    image_grid_thw=v.image_grid_thw,
                    mm_token_type_ids=(ids == IMAGE).to(torch.int32),
                ).logits[0]
            )
    reference = torch.cat(expected)
    logits = {}
    for (text, tower), root in arts.items():
        with qruntime.load(root, device="cpu", dtype=torch.float32, prefix_cache=False) as engine:
            got = torch.cat([engine.score(p) for p in cases])
        logits[f"text {text}, tower {tower}"] = {"sqnr_db": sqnr_db(got, reference), "max_rel": max_rel(got, reference)}
    return {"encoder_fp8_vs_model_dtype": parts, "logits_vs_transformers_fp32": logits, "positions": len(reference)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts with images, per checkpoint")
    parser.add_argument("--seed", type=int, default=None, help="images and prompts (checkpoints print theirs)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vision_fp8_accuracy.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))  # the tiny checkpoints' builder
    seed = random.randrange(1 << 30) if args.seed is None else args.seed
    print(f"seed {seed}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    report = report_header("vision_fp8_accuracy")
    report["device"] = "cpu (fp32 compute)"
    report["settings"] = {"prompts": args.prompts, "seed": seed, "image_sizes": SIZES}
    with tempfile.TemporaryDirectory() as tmp:
        report["results"] = {kind: measure_kind(kind, Path(tmp), rng, args.prompts) for kind in ("dense", "moe")}
    print(json.dumps(report["results"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
