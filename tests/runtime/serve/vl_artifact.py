"""A tiny Qwen3-VL artifact with a tokenizer, for serving images: tests/qwen3_vl_checkpoints.py's
dense model (random weights from a fresh printed seed, its preprocessor) over the tiny synthetic
tokenizer's 544-token vocabulary instead of 128 ids without one, its image / video / vision_start /
vision_end ids the tokenizer's own special tokens; compiled by qcompile (bf16 recipe: unquantized,
the checkpoint's float32)."""

from __future__ import annotations

from pathlib import Path

from qwen3_vl_checkpoints import write_checkpoint

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe
from qcompile.synth import get_preset
from qcompile.synth.tokenizer import QWEN_ADDED_TOKENS, TokenizerLayout, write_tokenizer_files


def write_vl_checkpoint(out: Path) -> Path:
    """The tiny Qwen3-VL checkpoint at `out`, with the tiny synthetic tokenizer and a preprocessor config."""
    tiny = get_preset("tiny").config()  # its tokenizer: bos / eos, the 544-token vocabulary
    layout = TokenizerLayout.from_config(tiny)
    names = [name for name, _ in QWEN_ADDED_TOKENS]
    at = {key: layout.specials_start + names.index(f"<|{key}|>") for key in ("image_pad", "video_pad")}
    at.update({key: layout.specials_start + names.index(f"<|{key}|>") for key in ("vision_start", "vision_end")})
    token_ids = {
        "image_token_id": at["image_pad"],
        "video_token_id": at["video_pad"],
        "vision_start_token_id": at["vision_start"],
        "vision_end_token_id": at["vision_end"],
    }
    text = {key: tiny[key] for key in ("vocab_size", "bos_token_id", "eos_token_id")}
    write_checkpoint(out, "dense", text=text, token_ids=token_ids, tied=False)
    write_tokenizer_files(tiny, out)
    return out


def compile_vl_artifact(root: Path) -> Path:
    """root/ckpt (write_vl_checkpoint) compiled to root/artifact, which is returned."""
    ckpt = write_vl_checkpoint(root / "ckpt")
    out = root / "artifact"
    compile_checkpoint(prepare(ckpt, load_recipe("bf16")), out, workers=1, progress=False)
    return out
