"""Helpers of the pre-quantized input tests (test_prequantized_*.py): llm-compressor writes the
quantized checkpoints (oneshot or model_free_ptq, saved compressed), we compile them and the bf16
originals, and compare the artifacts file by file."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from llmc_reference import Tensors, run_model_free, run_oneshot
from safetensors.torch import load_file, save_file

from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.prequantized import default_recipe
from qcompile.recipe.schema import load_recipe
from qcompile.source.checkpoint import TOKENIZER_FILES

RUNS = {"oneshot": run_oneshot, "model_free": run_model_free}


def quantize_with_llmcompressor(
    ckpt: Path, out: Path, scheme: str, ignore: Iterable[str], tool: str = "oneshot"
) -> Path:
    """`ckpt` quantized by llm-compressor (`scheme`: a preset or llmc_reference.TENSOR_FP8) and saved
    compressed at `out`, with the source's tokenizer files beside it (llm-compressor saves the model only)."""
    RUNS[tool](ckpt, out, scheme, list(ignore))
    for name in TOKENIZER_FILES:
        if (ckpt / name).is_file() and not (out / name).exists():
            shutil.copyfile(ckpt / name, out / name)
    return out


def compile_to(ckpt: Path, out: Path, recipe: str | None = None, overrides: Iterable[str] = ()) -> Path:
    """Compile `ckpt` at `out` as `qcompile compile` does: without a recipe, the checkpoint's own."""
    resolved = load_recipe(recipe or default_recipe(ckpt), list(overrides))
    compile_checkpoint(prepare(ckpt, resolved), out, workers=2, progress=False)
    return out


def cached_compiler(workdir: Path) -> Callable[..., Path]:
    """`compiled(ckpt, recipe=None, *overrides)`: compile_to into `workdir`, each artifact once (a test
    module's `compiled` fixture)."""
    made: dict[tuple, Path] = {}

    def get(ckpt: Path, recipe: str | None = None, *overrides: str) -> Path:
        key = (str(ckpt), recipe, overrides)
        if key not in made:
            made[key] = compile_to(ckpt, workdir / f"art-{len(made)}", recipe, overrides)
        return made[key]

    return get


def artifact_files(art: Path) -> dict[str, bytes]:
    """The bytes of every weight file and graph of an artifact, by relative path."""
    files = sorted(art.glob("weights/**/*.safetensors")) + sorted(art.glob("graph*.onnx"))
    return {p.relative_to(art).as_posix(): p.read_bytes() for p in files}


def assert_same_artifact(ours: Path, reference: Path) -> None:
    """The same weight files and graphs, byte for byte (the manifests differ: source and ignore list)."""
    a, b = artifact_files(ours), artifact_files(reference)
    assert sorted(a) == sorted(b), f"files differ: {sorted(a)} vs {sorted(b)}"
    differ = [name for name in a if a[name] != b[name]]
    if differ:
        detail = []
        for name in differ:
            if name.endswith(".safetensors"):
                ta, tb = load_file(ours / name), load_file(reference / name)
                bad = [
                    k for k in ta if k not in tb or not torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8))
                ]
                detail.append(f"{name}: tensors {bad[:5]}")
            else:
                detail.append(name)
        raise AssertionError("artifact files differ: " + "; ".join(detail))


def make_checkpoints(make_ckpt: Callable[..., Path], presets: dict[str, tuple[str, dict]]) -> dict[str, Path]:
    """kind -> a synthesized checkpoint of (preset, config overrides), all of one fresh seed (printed)."""
    seed = random.randrange(1 << 30)
    print(f"checkpoint seed {seed}")
    return {kind: make_ckpt(preset, seed=seed, **shapes) for kind, (preset, shapes) in presets.items()}


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=shutil.copyfile)  # the fixtures' dirs stay untouched
    return dst


def rewrite_tensors(ckpt: Path, edit: Callable[[Tensors], None]) -> None:
    """Load each shard of `ckpt`, let `edit` change its dict in place, write it back."""
    for file in sorted(ckpt.glob("*.safetensors")):
        tensors = load_file(file)
        edit(tensors)
        save_file(tensors, file, metadata={"format": "pt"})


def edit_config(ckpt: Path, edit: Callable[[dict], None]) -> None:
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))
