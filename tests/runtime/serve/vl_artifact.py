"""A tiny Qwen3-VL artifact with a tokenizer, for serving images: tests/qwen3_vl_checkpoints.py's
dense model (random weights from a fresh printed seed, its preprocessor) over the tiny synthetic
tokenizer's 544-token vocabulary instead of 128 ids without one, its image / video / vision_start /
vision_end ids the tokenizer's own special tokens; compiled by qcompile (bf16 recipe: unquantized,
the checkpoint's float32)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from qwen3_vl_checkpoints import PREPROCESSOR, TEXT, VISION, randomize

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe
from qcompile.synth import get_preset
from qcompile.synth.tokenizer import QWEN_ADDED_TOKENS, TokenizerLayout, write_tokenizer_files


def write_vl_checkpoint(out: Path) -> Path:
    """The tiny Qwen3-VL checkpoint at `out`, with the tiny synthetic tokenizer and a preprocessor config."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tiny = get_preset("tiny").config()  # its tokenizer: bos / eos, the 544-token vocabulary
    layout = TokenizerLayout.from_config(tiny)
    names = [name for name, _ in QWEN_ADDED_TOKENS]
    keys = ("image_pad", "video_pad", "vision_start", "vision_end")
    ids = {key: layout.specials_start + names.index(f"<|{key}|>") for key in keys}
    text = dict(
        TEXT, vocab_size=tiny["vocab_size"], bos_token_id=tiny["bos_token_id"], eos_token_id=tiny["eos_token_id"]
    )
    config = Qwen3VLConfig(
        vision_config=VISION,
        text_config=text,
        tie_word_embeddings=False,
        image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
    )
    model = Qwen3VLForConditionalGeneration(config)
    seed = random.randrange(1 << 30)
    print(f"checkpoint seed {seed}")
    randomize(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(out)
    write_tokenizer_files(tiny, out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return out


def compile_vl_artifact(root: Path) -> Path:
    """root/ckpt (write_vl_checkpoint) compiled to root/artifact, which is returned."""
    ckpt = write_vl_checkpoint(root / "ckpt")
    out = root / "artifact"
    compile_checkpoint(prepare(ckpt, load_recipe("bf16")), out, workers=1, progress=False)
    return out
