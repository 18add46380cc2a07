"""spec_bench.py --train: a target Qwen3 and a ~4x smaller draft sharing its tokenizer, trained on
Python source (examples/train_small_qwen3.py's tokenizer and training loop), saved as Hugging Face
checkpoints and compiled by qcompile into artifacts.

The corpus is examples/train_small_qwen3.py's stdlib files plus TrainPlan.site_chars characters of
installed packages' sources (bench/spec_corpus.py: no tests, no file named after or copying a held-out
module). The stdlib alone is ~2.0M tokens: the bench target saw it 17 times and memorized it (at
568c92f on an H200: train loss 0.089, held-out perplexity 100), a model that neither generalizes
nor copies. The tokenizer is still trained on the stdlib files only (fast, and the same vocabulary
with or without site text), and so is the calibration text of --draft-layers auto.

Each model trains for a time budget: a few probe steps time one step on this device, and the step
count (hence the cosine schedule) is set so the run fits the budget. The weights go to the work
directory only; nothing here is committed.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_small_qwen3 as trainer  # noqa: E402 -- examples/ is scripts, not a package
from spec_corpus import site_texts  # noqa: E402
from spec_prompts import heldout_sources  # noqa: E402

Log = Callable[[str], None]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass(frozen=True)
class TrainPlan:
    """Shapes and batches of the pair. The draft shares the target's width and vocabulary (hence the
    tokenizer) with a quarter of its layers: at batch 1 a step's latency follows the layer count."""

    target: trainer.ModelShape
    draft: trainer.ModelShape
    batch_size: int
    seq_len: int
    target_lr: float
    draft_lr: float
    max_files: int | None = None  # train on the first this many stdlib files (None: all)
    site_chars: int = 0  # characters of site-packages sources added to them (spec_corpus.site_texts)


TRAIN_PLANS = {
    # target: 16 x 6.3M + 3.1M embedding = 104M parameters; draft: 4 layers, 28M (3.7x smaller)
    "bench": TrainPlan(
        target=trainer.ModelShape(
            hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4
        ),
        draft=trainer.ModelShape(
            hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4
        ),
        batch_size=32,
        seq_len=512,
        target_lr=8e-4,
        draft_lr=1.5e-3,
        site_chars=100_000_000,  # ~35M tokens (2.9 chars a token): the default 210 s budget's 35M about once
    ),
    # a smoke test of the path on a CPU: minutes, not a model worth measuring
    "tiny": TrainPlan(
        target=trainer.ModelShape(
            trained_vocab=960,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        draft=trainer.ModelShape(
            trained_vocab=960,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        batch_size=4,
        seq_len=64,
        target_lr=3e-3,
        draft_lr=3e-3,
        max_files=40,
    ),
}


def train_pair(
    plan: TrainPlan,
    workdir: Path,
    device: torch.device,
    seconds: dict[str, float],
    log: Log,
    seed: int = 0,
    steps: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Train the target and the draft under workdir (target/, draft/: HF checkpoints with the same
    tokenizer files), each for about seconds[name], or for exactly steps[name] steps where given (no
    probe: two runs then train the same models, up to the device's nondeterminism, where a time
    budget gives as many steps as the machine of the day manages). Returns the record of the training."""
    import transformers
    from tokenizers import Tokenizer

    from qcompile.synth.tokenizer import ENDOFTEXT, write_tokenizer_files

    root = trainer.stdlib_root()
    texts = trainer.training_texts(root)[: plan.max_files]
    site, site_record = site_texts(plan.site_chars, heldout_sources(root), seed=seed)
    heldout, _ = trainer.heldout_text(root, separator=ENDOFTEXT)
    configs = {
        name: trainer.qwen3_config(shape, transformers.__version__)
        for name, shape in (("target", plan.target), ("draft", plan.draft))
    }
    dirs = {name: workdir / name for name in configs}
    for path in dirs.values():
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    start = time.perf_counter()
    write_tokenizer_files(configs["target"], dirs["target"], corpus=texts)
    for name in TOKENIZER_FILES:  # one tokenizer: the draft's vocabulary must be the target's
        shutil.copy(dirs["target"] / name, dirs["draft"] / name)
    tokenizer = Tokenizer.from_file(str(dirs["target"] / "tokenizer.json"))
    stream = trainer.token_stream(tokenizer, texts + site, configs["target"]["vocab_size"])
    windows = trainer.heldout_windows(tokenizer.encode(heldout, add_special_tokens=False).ids, plan.seq_len)
    record: dict[str, Any] = {
        "corpus": {
            "stdlib": str(root),
            "files": len(texts),
            "chars": sum(map(len, texts)),
            "site": site_record,
            "tokens": len(stream),  # stdlib and site text
            "heldout_windows": len(windows),
        },
        "tokenizer_s": round(time.perf_counter() - start, 1),
        "device": str(device),
    }
    log(
        f"corpus: {len(texts)} stdlib files, {site_record['files']} site-packages files "
        f"({site_record['chars']:,} chars), {len(stream):,} tokens; tokenizer and stream in {record['tokenizer_s']} s"
    )
    for name, config in configs.items():
        lr = plan.target_lr if name == "target" else plan.draft_lr
        cfg = _config(dirs[name], plan, lr, steps=20, seed=seed)
        given = (steps or {}).get(name)
        if given is not None:
            count = given
            log(f"{name}: {count} steps, as given")
        else:
            step_s = _probe_step_seconds(config, stream, windows, cfg, device, log)
            count = max(8, int(seconds[name] / step_s))
            log(f"{name}: {step_s * 1e3:.0f} ms a step -> {count} steps for {seconds[name]:.0f} s")
        cfg = replace(cfg, steps=count, warmup=min(100, count // 10), eval_every=max(1, count // 4))
        model = _model(config, device, seed)
        stats = trainer.train(model, stream, windows, cfg, log)
        (dirs[name] / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        trainer.save_weights(model, dirs[name])
        nll = trainer.mean_nll(model, windows, autocast=device.type == "cuda")
        record[name] = {
            "checkpoint": str(dirs[name]),
            "parameters": sum(p.numel() for p in model.parameters()),
            "shape": asdict(getattr(plan, name)),
            "train_config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
            "steps_from": "given" if given is not None else f"a {seconds[name]:g} s budget",
            "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
            "final_train_loss": round(stats["final_train_loss"], 4),
            "heldout_perplexity": round(math.exp(nll), 3),
            "train_seconds": round(stats["train_seconds"], 1),
        }
        log(f"{name}: {record[name]['parameters']:,} parameters, held-out ppl {record[name]['heldout_perplexity']}")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return record


CALIB_BYTES = 200_000  # --draft-layers auto's calibration text: training files (it reads 16 x 256 tokens)


def compile_pair(workdir: Path, recipe: str, log: Log) -> dict[str, Path]:
    """qcompile both checkpoints with `recipe` into workdir/{target,draft}-RECIPE. The target also
    records a self-speculative draft (--draft-layers auto, searched on training text) for layer-skip."""
    from qcompile.compile.pipeline import compile_checkpoint, prepare
    from qcompile.recipe.schema import load_recipe

    calib = workdir / "calib.txt"
    calib.write_text(_calibration_text(), encoding="utf-8")
    artifacts = {}
    for name in ("target", "draft"):
        out = workdir / f"{name}-{recipe}"
        start = time.perf_counter()
        options = {"calib": calib, "draft_layers": "auto"} if name == "target" else {}
        prepared = prepare(workdir / name, load_recipe(recipe), **options)
        compile_checkpoint(prepared, out, force=True, workers=2, progress=False)
        drafted = f", draft skips layers {list(prepared.speculative.layers)}" if prepared.speculative else ""
        log(f"compiled {name} with {recipe} in {time.perf_counter() - start:.1f} s{drafted} -> {out}")
        artifacts[name] = out
    return artifacts


def _calibration_text() -> str:
    """The first CALIB_BYTES of the training files (never the held-out ones the bench prompts with)."""
    text = ""
    for source in trainer.training_texts(trainer.stdlib_root()):
        text += source + "\n\n"
        if len(text) >= CALIB_BYTES:
            break
    return text[:CALIB_BYTES]


def _config(out: Path, plan: TrainPlan, lr: float, steps: int, seed: int) -> trainer.TrainConfig:
    return trainer.TrainConfig(
        out=out,
        steps=steps,
        batch_size=plan.batch_size,
        seq_len=plan.seq_len,
        lr=lr,
        min_lr_ratio=0.1,
        warmup=0,
        weight_decay=0.1,
        seed=seed,
        threads=torch.get_num_threads(),
        eval_every=steps,
        eval_windows=2,
        force=True,
    )


def _model(config: dict[str, Any], device: torch.device, seed: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config.from_dict(config)).to(device)


def _probe_step_seconds(
    config: dict[str, Any], stream: torch.Tensor, windows: torch.Tensor, cfg: trainer.TrainConfig, device, log: Log
) -> float:
    """Seconds one training step takes here: the last half of cfg.steps probe steps on a throwaway
    model (the first ones pay for the allocator and kernel selection)."""
    model = _model(config, device, cfg.seed)
    half = replace(cfg, steps=cfg.steps // 2, eval_every=10**9, eval_windows=1)
    trainer.train(model, stream, windows[:1], half, lambda _: None)  # warm-up
    stats = trainer.train(model, stream, windows[:1], half, lambda _: None)
    del model
    return stats["train_seconds"] / half.steps
