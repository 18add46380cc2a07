"""Train a small Qwen3 on the Python standard library's source, on 2 CPU cores, in under 20 minutes.

The result is a genuine Qwen3ForCausalLM (QK-norm, GQA, tied embeddings like Qwen3-0.6B) of about
4M parameters with a byte-level BPE tokenizer of 4,064 learned tokens plus Qwen's added tokens,
trained on text every machine of the project has offline: the running Python's standard library.
Whole modules (HELDOUT_MODULES) are held out of both the tokenizer and the model; a fixed excerpt
of them is written as heldout.txt so evaluation is identical wherever the fixture is used.

    python examples/train_small_qwen3.py --out tests/fixtures/qwen3-stdlib

writes config.json, generation_config.json, model.safetensors (bf16), tokenizer.json,
tokenizer_config.json, special_tokens_map.json, heldout.txt, training.json and TRAINING.md. The
directory appears only when complete. Held-out perplexity is that of the saved bf16 weights, run
by transformers in fp32 over non-overlapping windows of --seq-len tokens of heldout.txt (each
window predicts its tokens after the first).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import tokenizers
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from qcompile.io.atomic import atomic_output_dir
from qcompile.synth.presets import get_preset
from qcompile.synth.tokenizer import ENDOFTEXT, QWEN_ADDED_TOKENS, write_tokenizer_files

# Python's own modules, sorted; a module missing from this installation is skipped.
TRAIN_MODULES = tuple(
    """
    __future__ _collections_abc _compat_pickle _compression _markupbase _osx_support _py_abc _pydecimal _pyio
    _sitebuiltins _strptime _threading_local _weakrefset abc aifc argparse ast asynchat asyncore base64 bdb bisect
    bz2 cProfile cgi cgitb chunk cmd code codecs codeop compileall configparser contextlib contextvars copy copyreg
    crypt csv dataclasses datetime decimal difflib dis doctest enum filecmp fileinput fnmatch ftplib functools
    genericpath getopt getpass gettext glob gzip hashlib heapq hmac imaplib imghdr imp inspect io ipaddress keyword
    linecache locale lzma mailbox mailcap mimetypes modulefinder nntplib ntpath nturl2path numbers opcode operator
    optparse os pathlib pdb pickle pickletools pipes pkgutil platform plistlib poplib posixpath pprint profile pstats
    pty py_compile pyclbr pydoc quopri random reprlib rlcompleter runpy secrets selectors shelve shutil signal site
    smtpd smtplib sndhdr socket socketserver sre_compile sre_constants sre_parse ssl stat string stringprep struct
    subprocess sunau symtable sysconfig tabnanny tarfile telnetlib tempfile threading timeit token tokenize trace
    traceback tracemalloc tty turtle types typing uu uuid warnings wave weakref webbrowser xdrlib zipapp zipfile
    zipimport
    """.split()  # noqa: SIM905 -- a word list reads better than 170 quoted strings
)
# Packages whose .py files (sorted, test directories left out) are trained on.
TRAIN_PACKAGES = tuple(
    """
    asyncio collections concurrent ctypes curses dbm distutils email ensurepip html http idlelib importlib json
    lib2to3 logging multiprocessing re sqlite3 tkinter tomllib turtledemo unittest urllib venv wsgiref xml xmlrpc
    zoneinfo
    """.split()  # noqa: SIM905
)
# Whole modules never trained on (tokenizer included); heldout.txt is an excerpt of them.
HELDOUT_MODULES = (
    "calendar",
    "colorsys",
    "fractions",
    "graphlib",
    "netrc",
    "queue",
    "sched",
    "shlex",
    "statistics",
    "textwrap",
)
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
HELDOUT_CHARS_PER_MODULE = 6_000  # the first this many characters of each module, cut at a line end
MIN_TRAIN_CHARS = 3_000_000
MIN_HELDOUT_MODULES = 6


@dataclass(frozen=True)
class ModelShape:
    """The model's size; the vocabulary is the tokenizer's, rounded up to a multiple of 64."""

    trained_vocab: int = 4064  # learned BPE tokens; Qwen's 26 added tokens follow, 4090 -> 4096 rows
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 2048


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the trained weights (plus where they go and how loudly)."""

    out: Path
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    seed: int
    threads: int
    eval_every: int
    eval_windows: int
    force: bool

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "seq_len", "threads", "eval_every", "eval_windows"):
            if getattr(self, key) <= 0:
                raise ValueError(f"--{key.replace('_', '-')} must be positive, got {getattr(self, key)}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"--warmup must be in [0, --steps), got {self.warmup} with {self.steps} steps")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--lr must be positive and --min-lr-ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}")


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output checkpoint directory (must not exist)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists (once the new one is complete)")
    p.add_argument("--steps", type=int, default=2200, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: %(default)s)")
    p.add_argument(
        "--seq-len", type=int, default=256, help="tokens per sequence and eval window (default: %(default)s)"
    )
    p.add_argument("--lr", type=float, default=1.5e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR / peak LR (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay of matrices (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of initialization and batches (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=250, help="steps between held-out evals (default: %(default)s)")
    p.add_argument(
        "--eval-windows", type=int, default=8, help="held-out windows scored during training (default: %(default)s)"
    )
    args = p.parse_args(argv)
    return TrainConfig(**vars(args))


# ---------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def training_files(root: Path) -> list[Path]:
    """TRAIN_MODULES then TRAIN_PACKAGES' files, in a fixed order; held-out modules never appear."""
    files = [root / f"{name}.py" for name in TRAIN_MODULES if (root / f"{name}.py").is_file()]
    for package in TRAIN_PACKAGES:
        found = sorted((root / package).rglob("*.py")) if (root / package).is_dir() else []
        files += [f for f in found if not TEST_DIRS & set(f.relative_to(root).parts)]
    heldout = {root / f"{name}.py" for name in HELDOUT_MODULES}
    if leaked := sorted(heldout & set(files)):
        raise RuntimeError(f"held-out modules in the training files: {leaked}")  # a bug in the lists above
    return files


def training_texts(root: Path) -> list[str]:
    texts = [_read(path) for path in training_files(root)]
    total = sum(map(len, texts))
    if total < MIN_TRAIN_CHARS:
        raise RuntimeError(
            f"{root}: only {total:,} characters of training text found in the standard library "
            f"(need {MIN_TRAIN_CHARS:,}); is this a complete Python installation?"
        )
    return texts


def heldout_text(root: Path, separator: str) -> tuple[str, list[str]]:
    """The first HELDOUT_CHARS_PER_MODULE characters (to a line end) of each held-out module,
    joined by `separator`; and the modules found."""
    parts, found = [], []
    for name in HELDOUT_MODULES:
        path = root / f"{name}.py"
        if path.is_file():
            text = _read(path)[:HELDOUT_CHARS_PER_MODULE]
            parts.append(text[: text.rfind("\n") + 1])
            found.append(name)
    if len(found) < MIN_HELDOUT_MODULES:
        raise RuntimeError(f"{root}: only {found} of the held-out modules {HELDOUT_MODULES} exist")
    return separator.join(parts), found


# ---------------------------------------------------------------- model


def qwen3_config(shape: ModelShape, transformers_version: str) -> dict[str, Any]:
    """Qwen3-0.6B's published config.json (tied embeddings) at this size."""
    bos = shape.trained_vocab  # <|endoftext|>, the first added token; eos is <|im_end|> two later
    changes = {
        **{k: v for k, v in asdict(shape).items() if k != "trained_vocab"},
        "max_window_layers": shape.num_hidden_layers,
        "bos_token_id": bos,
        "eos_token_id": bos + 2,
        "vocab_size": -(-(bos + len(QWEN_ADDED_TOKENS)) // 64) * 64,
        "transformers_version": transformers_version,
    }
    config = get_preset("qwen3-0.6b").config()
    if unknown := sorted(set(changes) - set(config)):
        raise KeyError(f"not keys of Qwen3's config.json: {unknown}")
    return {**config, **changes}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine down to cfg.lr * cfg.min_lr_ratio at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def heldout_windows(ids: list[int], seq_len: int) -> torch.Tensor:
    """Non-overlapping windows [W, seq_len] of the held-out ids (a partial last window is dropped)."""
    count = len(ids) // seq_len
    return torch.tensor(ids[: count * seq_len], dtype=torch.long).view(count, seq_len)


def mean_nll(model: torch.nn.Module, windows: torch.Tensor, autocast: bool, batch: int = 8) -> float:
    """Mean next-token negative log-likelihood over the windows (first token of each not predicted),
    on the model's device."""
    device = next(model.parameters()).device
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        for chunk in windows.to(device).split(batch):
            logits = model(input_ids=chunk).logits[:, :-1].float()  # [B, S-1, V]
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum")
            total, count = total + float(nll), count + chunk[:, 1:].numel()
    model.train()
    return total / count


def train(
    model: torch.nn.Module, stream: torch.Tensor, heldout: torch.Tensor, cfg: TrainConfig, log: Callable[[str], None]
) -> dict[str, float]:
    """AdamW with warmup + cosine LR on random windows of `stream`, bf16 autocast, on the model's
    device (`stream` and `heldout` stay on the CPU; each batch is copied over); returns final stats."""
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"  # one kernel for the whole update instead of a loop over tensors
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    batches = torch.Generator().manual_seed(cfg.seed)
    offsets_range = len(stream) - cfg.seq_len - 1
    span = torch.arange(cfg.seq_len + 1)
    recent: list[float] = []
    start = time.perf_counter()
    model.train()
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        offsets = torch.randint(0, offsets_range, (cfg.batch_size, 1), generator=batches)
        tokens = stream[offsets + span].long().to(device)  # [B, S+1]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=tokens[:, :-1]).logits  # [B, S, V]
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-50:]
        done = step + 1
        if done % 50 == 0 or done == cfg.steps:
            elapsed = time.perf_counter() - start
            rate = done * cfg.batch_size * cfg.seq_len / elapsed
            log(
                f"step {done:5d}/{cfg.steps}  lr {lr_at(step, cfg):.2e}  train loss {sum(recent) / len(recent):.4f}  "
                f"{rate:,.0f} tok/s  {elapsed / 60:.1f} min"
            )
        if done % cfg.eval_every == 0 or done == cfg.steps:
            nll = mean_nll(model, heldout[: cfg.eval_windows], autocast=True)
            log(f"step {done:5d}  held-out loss {nll:.4f} (ppl {math.exp(nll):.2f}, first {cfg.eval_windows} windows)")
    return {"final_train_loss": sum(recent) / len(recent), "train_seconds": time.perf_counter() - start}


def token_stream(tokenizer: Tokenizer, texts: Sequence[str], vocab_size: int, chunk: int = 512) -> torch.Tensor:
    """The training texts' token ids in one stream, each text followed by <|endoftext|> (int16 when
    the vocabulary fits). Encoded `chunk` texts at a time into an array each: a corpus of tens of
    millions of tokens never lives as Python ints or as all its Encoding objects at once."""
    eot = tokenizer.token_to_id(ENDOFTEXT)
    dtype = np.int16 if vocab_size <= 32767 else np.int32
    parts = [np.zeros(0, dtype=dtype)]
    for i in range(0, len(texts), chunk):
        for encoding in tokenizer.encode_batch(list(texts[i : i + chunk]), add_special_tokens=False):
            parts.append(np.array([*encoding.ids, eot], dtype=dtype))
    return torch.from_numpy(np.concatenate(parts))


def save_weights(model: torch.nn.Module, out: Path) -> None:
    """model.safetensors in bf16, without lm_head.weight (tied to the embedding, as in Qwen3-0.6B)."""
    weights = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    weights.pop("lm_head.weight")
    safetensors.torch.save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------- main


def run(cfg: TrainConfig, argv: Sequence[str]) -> dict[str, Any]:
    """Corpus, tokenizer, training, bf16 checkpoint, held-out eval and the record, into cfg.out."""
    import transformers  # here, not at import: importing this module for its corpus stays cheap
    from transformers import Qwen3Config, Qwen3ForCausalLM

    began = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:7.1f}s] {message}", flush=True)

    torch.set_num_threads(cfg.threads)
    shape = ModelShape()
    config = qwen3_config(shape, transformers.__version__)
    root = stdlib_root()
    texts = training_texts(root)
    heldout, heldout_found = heldout_text(root, separator=ENDOFTEXT)
    log(f"corpus: {len(texts)} training files, {sum(map(len, texts)):,} chars from {root}; held out {heldout_found}")

    with atomic_output_dir(cfg.out, cfg.force) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        write_tokenizer_files(config, tmp, corpus=texts)
        (tmp / "heldout.txt").write_text(heldout, encoding="utf-8")
        tokenizer = Tokenizer.from_file(str(tmp / "tokenizer.json"))
        stream = token_stream(tokenizer, texts, config["vocab_size"])
        windows = heldout_windows(tokenizer.encode(heldout, add_special_tokens=False).ids, cfg.seq_len)
        log(
            f"tokenizer: {tokenizer.get_vocab_size()} tokens; {len(stream):,} training tokens, {len(windows)} held-out windows"
        )

        torch.manual_seed(cfg.seed)
        model = Qwen3ForCausalLM(Qwen3Config.from_dict(config))
        parameters = sum(p.numel() for p in model.parameters())
        log(f"model: {parameters:,} parameters; {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens")
        stats = train(model, stream, windows, cfg, log)

        save_weights(model, tmp)
        saved = Qwen3ForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        nll_all = mean_nll(saved, windows, autocast=False)
        nll_first = mean_nll(saved, windows[: cfg.eval_windows], autocast=False)
        log(f"bf16 checkpoint, fp32 compute: held-out ppl {math.exp(nll_all):.3f} over {len(windows)} windows")

        record = {
            "command": shlex.join(["python", *argv]),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
            },
            "machine": f"{os.cpu_count()} CPUs ({platform.machine()}), {cfg.threads} torch threads",
            "train_config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
            "model_shape": asdict(shape),
            "parameters": parameters,
            "corpus": {
                "stdlib": str(root),
                "training_files": len(texts),
                "training_chars": sum(map(len, texts)),
                "training_tokens": len(stream),
                "heldout_modules": heldout_found,
            },
            "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
            "final_train_loss": round(stats["final_train_loss"], 4),
            "heldout": {
                "seq_len": cfg.seq_len,
                "windows": len(windows),
                "perplexity": round(math.exp(nll_all), 4),
                "first_windows": cfg.eval_windows,
                "first_windows_perplexity": round(math.exp(nll_first), 4),
            },
            "train_seconds": round(stats["train_seconds"], 1),
            "wall_seconds": round(time.perf_counter() - began, 1),
            "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir())},
        }
        (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        (tmp / "TRAINING.md").write_text(training_md(record), encoding="utf-8")
    log(f"wrote {cfg.out} in {record['wall_seconds'] / 60:.1f} min")
    return record


def training_md(r: dict[str, Any]) -> str:
    h, v = r["heldout"], r["versions"]
    files = "\n".join(f"| {name} | {size:,} |" for name, size in r["files"].items())
    return f"""# qwen3-stdlib: a small Qwen3 trained on the Python standard library

Made by `examples/train_small_qwen3.py` (its docstring says what it does); the numbers below are also
in `training.json`. `heldout.txt` is an excerpt of CPython's standard library (PSF License), from
modules that neither the tokenizer nor the model saw in training.

    {r["command"]}

| | |
|---|---|
| date | {r["date"]} |
| versions | Python {v["python"]}, torch {v["torch"]}, transformers {v["transformers"]}, tokenizers {v["tokenizers"]} |
| machine | {r["machine"]} |
| parameters | {r["parameters"]:,} (tied embeddings) |
| corpus | {r["corpus"]["training_files"]} files, {r["corpus"]["training_chars"]:,} chars, {r["corpus"]["training_tokens"]:,} tokens |
| held-out modules | {", ".join(r["corpus"]["heldout_modules"])} |
| steps | {r["train_config"]["steps"]} x {r["train_config"]["batch_size"]} x {r["train_config"]["seq_len"]} = {r["tokens_seen"]:,} tokens |
| final train loss | {r["final_train_loss"]} (mean of the last 50 steps) |
| held-out perplexity | **{h["perplexity"]}** over all {h["windows"]} windows of {h["seq_len"]} tokens |
| held-out perplexity, first {h["first_windows"]} windows | {h["first_windows_perplexity"]} |
| training time | {r["train_seconds"] / 60:.1f} min |
| wall time (corpus, tokenizer, training, eval) | {r["wall_seconds"] / 60:.1f} min |

Perplexity is that of the bf16 weights in model.safetensors run by transformers in fp32: heldout.txt
tokenized without added special tokens, cut into non-overlapping windows of {h["seq_len"]} tokens (a
partial last window dropped), each window predicting its tokens after the first.

| file | bytes |
|---|---|
{files}
"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    try:
        cfg = parse_args(argv[1:])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run(cfg, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
