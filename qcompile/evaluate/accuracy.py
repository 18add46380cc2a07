"""Accuracy of a compiled artifact against a reference model on the same text.

The text is tokenized with the artifact's tokenizer and cut into windows of `window` tokens;
consecutive windows share one token, so every token after the first is predicted exactly once, from
the tokens before it in its window (at most window - 1 of them). For every predicted token both
models' fp32 next-token logits are turned into log-probabilities in float64 (in fp32, the rounding
of log-sum-exp alone, about 5e-7 nats, would hide the KL of two near-identical models) and summed
in float64:

    perplexity       exp(mean negative log-likelihood), of each model; ratio = artifact / reference
    KL               mean over tokens of KL(reference || artifact), in nats
    top-1 agreement  share of positions where both models' most likely next token is the same

The reference is either a Hugging Face checkpoint run by transformers (`AutoModelForCausalLM`, the
independent implementation: the default for a source checkpoint) or another artifact, normally the
`bf16` compile of the same checkpoint, run by qruntime's reference (torch) backend. Both models
compute in the same dtype (bf16 by default, as the artifact is served; fp32 leaves only the
quantization error). The same inputs give bit-identical numbers on the same machine.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from qcompile.errors import EvalError
from qcompile.evaluate.models import Reference, load_engine, open_reference, resolve_device, resolve_dtype

DEFAULT_WINDOW = 512
ROWS_PER_CHUNK = 64  # positions turned into float64 log-probabilities at once (bounds memory at large vocabularies)


@dataclass(frozen=True)
class EvalResult:
    """The metrics of one artifact against one reference, and what they were measured on."""

    artifact: str
    recipe: str  # the artifact's recipe name, from its manifest
    reference: str
    reference_kind: str  # "transformers" (a checkpoint) or "qruntime" (an artifact, reference backend)
    data: str
    device: str
    dtype: str
    backend: str  # the artifact's runtime backend
    window: int  # tokens per window (after the cap by the engine's max_model_len)
    windows: int
    tokens: int  # predicted tokens, the denominator of every mean
    nll_artifact: float  # mean negative log-likelihood, nats/token
    nll_reference: float
    ppl_artifact: float
    ppl_reference: float
    ppl_ratio: float  # ppl_artifact / ppl_reference
    kl: float  # mean KL(reference || artifact), nats/token
    top1_agreement: float  # in [0, 1]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_text(data: str | Path) -> str:
    """The evaluation text: a UTF-8 file with something besides whitespace in it."""
    path = Path(data)
    if not path.is_file():
        raise EvalError(f"{path}: data file not found" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise EvalError(f"{path}: not UTF-8 text ({exc})") from exc
    if not text.strip():
        raise EvalError(f"{path}: the data file has no text")
    return text


def window_starts(num_tokens: int, window: int) -> list[int]:
    """Starts of windows of `window` tokens overlapping by one, covering ids[0:num_tokens]."""
    return list(range(0, num_tokens - 1, window - 1))


def evaluate(
    artifact: str | Path,
    reference: str | Path | Reference,
    data: str | Path,
    *,
    window: int = DEFAULT_WINDOW,
    max_tokens: int | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str = "bf16",
    progress: bool = True,
) -> EvalResult:
    """Run ARTIFACT and REFERENCE (a checkpoint or artifact path, or an opened Reference to reuse across
    calls) on the text of DATA; see the module docstring for the metrics. max_tokens caps the tokens
    read from the text; progress shows a bar over the windows (on a terminal)."""
    if window < 2:
        raise EvalError(f"window must be at least 2 tokens, got {window}")
    if max_tokens is not None and max_tokens < 2:
        raise EvalError(f"max_tokens must be at least 2, got {max_tokens}")
    artifact, data = Path(artifact), Path(data)
    text = read_text(data)
    compute_dtype = resolve_dtype(dtype)
    engine = load_engine(artifact, resolve_device(device), compute_dtype, window)
    window = engine.max_model_len - 1
    ids = engine.tokenizer.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise EvalError(f"{data}: the text is {len(ids)} token(s); at least 2 are needed to predict one")
    if not isinstance(reference, str | Path):
        ref = reference
    else:
        ref = open_reference(reference, engine.runner.device, compute_dtype, window, progress)
    _check_same_vocabulary(engine, artifact, ref, text, ids)

    totals = Totals()
    starts = window_starts(len(ids), window)
    for number, start in enumerate(tqdm(starts, desc="eval", unit="window", disable=None if progress else True)):
        chunk = ids[start : start + window]
        ours, theirs = engine.score(chunk), ref.logits(chunk)  # [n, V] each
        for name, logits in (("artifact", ours), ("reference", theirs)):
            if not bool(torch.isfinite(logits).all()):
                raise EvalError(f"the {name} gave non-finite logits in window {number} (tokens {start}..)")
        targets = torch.tensor(chunk[1:], device=ours.device)
        totals.add(ours[:-1], theirs[:-1].to(ours.device), targets)

    nll_a, nll_r = totals.nll_artifact / totals.tokens, totals.nll_reference / totals.tokens
    manifest_recipe = _recipe_name(artifact)
    return EvalResult(
        artifact=str(artifact),
        recipe=manifest_recipe,
        reference=str(ref.path),
        reference_kind=ref.kind,
        data=str(data),
        device=str(engine.runner.device),
        dtype=str(compute_dtype).removeprefix("torch."),
        backend=engine.description["backend"],
        window=window,
        windows=len(starts),
        tokens=totals.tokens,
        nll_artifact=nll_a,
        nll_reference=nll_r,
        ppl_artifact=math.exp(nll_a),
        ppl_reference=math.exp(nll_r),
        ppl_ratio=math.exp(nll_a - nll_r),
        kl=totals.kl / totals.tokens,
        top1_agreement=totals.agree / totals.tokens,
    )


@dataclass
class Totals:
    """Float64 sums over every predicted token."""

    nll_artifact: float = 0.0
    nll_reference: float = 0.0
    kl: float = 0.0
    agree: int = 0
    tokens: int = 0

    def add(self, ours: torch.Tensor, theirs: torch.Tensor, targets: torch.Tensor) -> None:
        """ours, theirs: fp32 logits [n, V] predicting targets [n]."""
        for lo in range(0, targets.numel(), ROWS_PER_CHUNK):
            rows = slice(lo, lo + ROWS_PER_CHUNK)
            log_a = torch.log_softmax(ours[rows].double(), dim=-1)  # [r, V] float64
            log_r = torch.log_softmax(theirs[rows].double(), dim=-1)
            picked = targets[rows, None]
            self.nll_artifact -= float(log_a.gather(-1, picked).sum())
            self.nll_reference -= float(log_r.gather(-1, picked).sum())
            self.kl += float((log_r.exp() * (log_r - log_a)).sum())
            self.agree += int((ours[rows].argmax(-1) == theirs[rows].argmax(-1)).sum())
            self.tokens += picked.shape[0]


def _check_same_vocabulary(engine, artifact: Path, ref: Reference, text: str, ids: list[int]) -> None:
    """The two models must share the vocabulary (logit rows) and, where the reference has a tokenizer,
    tokenize the text the same way."""
    if engine.vocab_size != ref.vocab_size:
        raise EvalError(
            f"vocabulary mismatch: the artifact {artifact} has {engine.vocab_size} tokens, the reference "
            f"{ref.path} has {ref.vocab_size}; the reference must be the checkpoint the artifact was compiled from"
        )
    if not (ref.path / "tokenizer.json").is_file():
        return
    from qruntime.tokenizer import Tokenizer, TokenizerError

    try:
        theirs = Tokenizer.from_dir(ref.path)
    except TokenizerError as exc:
        raise EvalError(f"the reference's tokenizer cannot be read: {exc}") from exc
    ref_ids = theirs.encode(text)[: len(ids)]
    if ref_ids != ids:
        first = next(
            (i for i, (a, b) in enumerate(zip(ids, ref_ids, strict=False)) if a != b), min(len(ids), len(ref_ids))
        )
        raise EvalError(
            f"tokenizer mismatch: the artifact {artifact} ({engine.tokenizer.vocab_size} tokens) and the reference "
            f"{ref.path} ({theirs.vocab_size} tokens) tokenize the text differently from token {first} on"
        )


def _recipe_name(artifact: Path) -> str:
    from qruntime.artifact import read_manifest

    return str(read_manifest(artifact).get("recipe", {}).get("name", "?"))
