"""Self-speculative decoding's draft, chosen offline: which decoder layers the draft leaves out.

The runtime's layer-skip draft runs the model less some layers (qruntime engine/speculative/
layer_skip.py). Which ones is decided here, on calibration text, streaming the source checkpoint
one layer at a time (source_layers.py), so the search fits in the memory a compile does:

1. one pass through the full model: each layer's influence on the residual stream, 1 - the mean
   cosine similarity of its input and output hidden states (ShortGPT's "block influence"), and
   the full model's next-token choices (top-1 over the calibration tokens);
2. for a few draft sizes (1/8, 1/4, 3/8, 1/2 of the layers), a pass through the model less the
   least influential layers (never the first or the last): how often its top-1 agrees with the full
   model's, a stand-in for the greedy acceptance rate alpha;
3. the size with the best modelled speed-up for NUM_DRAFT_TOKENS drafts: the tokens a step keeps,
   (1 - alpha^(k+1)) / (1 - alpha), over the step's cost, 1 + k * (kept layers / layers) (decode reads
   weights: a draft token costs the share of the layers it runs). A model, not a measurement.

`--draft-layers 3,5,7` gives the layers instead (checked against the model; no search).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qcompile.compile.calibrate import CalibrationError, calibration_ids
from qcompile.compile.source_layers import SourceLayers
from qcompile.errors import QCompileError
from qcompile.source import model as hf
from qcompile.source.checkpoint import Checkpoint

NUM_DRAFT_TOKENS = 4  # the runtime's default k (SpeculativeConfig.num_tokens)
FRACTIONS = (1 / 8, 1 / 4, 3 / 8, 1 / 2)


@dataclass(frozen=True)
class DraftLayers:
    """The manifest's `speculative` entry: the layers the draft skips, and how often that draft's
    top-1 agreed with the model's on the calibration text (None: given, not searched)."""

    layers: tuple[int, ...]
    agreement: float | None = None
    calibration: tuple[str, str, int] | None = None  # file name, sha256, tokens

    def to_dict(self) -> dict:
        entry: dict = {"draft_layers": list(self.layers)}
        if self.agreement is not None:
            entry["agreement"] = round(self.agreement, 6)
        if self.calibration is not None:
            name, digest, tokens = self.calibration
            entry["calibration"] = {"file": name, "sha256": digest, "tokens": tokens}
        return entry


def parse_draft_layers(text: str, num_layers: int) -> tuple[int, ...] | str:
    """'auto', or comma-separated layer indexes (each in 0..num_layers-1, not every layer)."""
    if text.strip() == "auto":
        return "auto"
    try:
        layers = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise QCompileError(f"--draft-layers {text!r}: expected 'auto' or layer indexes like 3,5,7") from None
    if not layers or layers[0] < 0 or layers[-1] >= num_layers or len(layers) == num_layers:
        raise QCompileError(f"--draft-layers {text!r}: give some but not all of the model's layers 0..{num_layers - 1}")
    return layers


def modelled_speedup(agreement: float, kept: float, k: int = NUM_DRAFT_TOKENS) -> float:
    """Tokens per step over the step's cost (see the module docstring); kept: the draft's share of layers."""
    tokens = k + 1 if agreement >= 1 else (1 - agreement ** (k + 1)) / (1 - agreement)
    return tokens / (1 + k * kept)


def search_draft_layers(
    checkpoint: Checkpoint,
    calib: Path,
    *,
    seq_len: int = 256,
    max_sequences: int = 16,
    batch: int = 4,
    progress: Callable[[], None] | None = None,
) -> DraftLayers:
    """The draft's layers by the search of the module docstring; progress() after each layer run."""
    if checkpoint.quantization is not None:
        raise QCompileError(
            f"--draft-layers auto runs the source model in its own precision, and {checkpoint.path} is pre-quantized: "
            "give the layers (--draft-layers 3,5,7)"
        )
    num_layers = checkpoint.spec.num_hidden_layers
    if num_layers < 3:
        raise QCompileError(f"--draft-layers auto: {num_layers} layers leave none to skip but the first and last")
    source = SourceLayers(checkpoint, "--draft-layers auto")
    ids = calibration_ids(checkpoint, calib, seq_len, max_sequences)
    full, influence = _run(source, ids, (), batch, progress, measure=True)
    order = sorted(range(1, num_layers - 1), key=lambda i: influence[i])  # least influential first
    sizes = sorted({min(max(1, round(f * num_layers)), len(order)) for f in FRACTIONS})
    best: tuple[float, tuple[int, ...], float] | None = None
    for size in sizes:
        skip = tuple(sorted(order[:size]))
        draft, _ = _run(source, ids, skip, batch, progress)
        agreement = float((draft == full).float().mean())
        score = modelled_speedup(agreement, (num_layers - size) / num_layers)
        if best is None or score > best[0]:
            best = (score, skip, agreement)
    _, skip, agreement = best
    digest = hashlib.sha256(calib.read_bytes()).hexdigest()
    return DraftLayers(skip, agreement, (calib.name, digest, int(ids.numel())))


def search_runs(num_layers: int) -> int:
    """Layer runs search_draft_layers makes (for a progress bar): the full pass, then each size's."""
    sizes = {min(max(1, round(f * num_layers)), num_layers - 2) for f in FRACTIONS}
    return num_layers + sum(num_layers - size for size in sizes)


@torch.inference_mode()
def _run(
    source: SourceLayers,
    ids: torch.Tensor,
    skip: Sequence[int],
    batch: int,
    progress: Callable[[], None] | None,
    measure: bool = False,
) -> tuple[torch.Tensor, list[float]]:
    """Top-1 next tokens [N, T] of the model less `skip`; with `measure`, each layer's influence."""
    checkpoint = source.checkpoint
    hidden = source.embed(ids).to(source.dtype)  # [N, T, H]
    positions = torch.arange(ids.shape[1])[None]
    cos, sin = source.rotary(hidden[:1], positions)
    influence: list[float] = []
    kept = [i for i in range(checkpoint.spec.num_hidden_layers) if i not in set(skip)]
    for _, module in source.layers(kept):
        similarity = torch.zeros((), dtype=torch.float64)
        for start in range(0, ids.shape[0], batch):
            h = hidden[start : start + batch]
            out = module(
                h,
                attention_mask=None,  # causal (no padding: whole sequences)
                position_ids=positions.expand(h.shape[0], -1),
                position_embeddings=(cos, sin),
            )
            out = out[0] if isinstance(out, tuple) else out
            if measure:
                similarity += torch.nn.functional.cosine_similarity(h.float(), out.float(), dim=-1).double().sum()
            hidden[start : start + batch] = out
        if measure:
            influence.append(1 - float(similarity) / ids.numel())
        if progress is not None:
            progress()
    if not torch.isfinite(hidden).all():
        raise CalibrationError("the source model's hidden states on the calibration text are not finite")
    return _top1(checkpoint, hidden, source.config.rms_norm_eps), influence


def _top1(checkpoint: Checkpoint, hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """argmax of the logits (final RMSNorm, then lm_head or the tied embedding) of hidden [N, T, H]."""
    norm = checkpoint.entry(f"{hf.FINAL_NORM}.weight")
    head_name = f"{hf.EMBED}.weight" if checkpoint.spec.tie_word_embeddings else f"{hf.LM_HEAD}.weight"
    head = checkpoint.entry(head_name)
    weight, lm_head = norm.read_rows(0, norm.shape[0]).float(), head.read_rows(0, head.shape[0]).float()
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    rows = x.reshape(-1, x.shape[-1])
    top = torch.cat([(rows[i : i + 1024] @ lm_head.T).argmax(-1) for i in range(0, rows.shape[0], 1024)])
    return top.reshape(hidden.shape[:2])
