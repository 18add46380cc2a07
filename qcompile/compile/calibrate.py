"""Calibrated FP8 KV-cache scales: per layer, per tensor, from text run through the source model.

The source checkpoint runs one decoder layer at a time (transformers' own Qwen3 layer classes, each
layer's weights read from the shards and dropped after use), so memory holds one layer and the
calibration activations, never the model. Each layer's keys (after k_norm and RoPE: what the cache
stores) and values are taken from the cache the layer writes; the scale is amax(|x|) over every
calibration token / 448 (e4m3's largest value): static, per tensor, symmetric, as compressed-
tensors' kv_cache_scheme calibrated by llm-compressor with observer "static_minmax" gives it. Its
default observer ("minmax") keeps a moving average (weight 0.01) of each batch's min and max
instead, mostly the first batch's and never above the global amax (tests/test_kv_calibration_llmc.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from qcompile.compile.kvcache import KVScales
from qcompile.compile.source_layers import SourceLayers
from qcompile.errors import QCompileError
from qcompile.source.checkpoint import Checkpoint

FP8_MAX = 448.0


class CalibrationError(QCompileError):
    """The calibration text or run is unusable (file named)."""


def calibration_ids(checkpoint: Checkpoint, path: Path, seq_len: int, max_sequences: int) -> torch.Tensor:
    """The text of `path` tokenized with the checkpoint's tokenizer, as [N, seq_len] token ids
    (whole sequences only; at most max_sequences)."""
    from qruntime.tokenizer import Tokenizer, TokenizerError

    if not path.is_file():
        raise CalibrationError(f"{path}: calibration text not found")
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        tokenizer = Tokenizer.from_dir(checkpoint.path)
    except TokenizerError as exc:
        raise CalibrationError(f"{checkpoint.path}: cannot load the tokenizer to calibrate with ({exc})") from exc
    ids = tokenizer.encode(text)
    count = min(len(ids) // seq_len, max_sequences)
    if count == 0:
        raise CalibrationError(f"{path}: {len(ids)} tokens, fewer than one calibration sequence of {seq_len}")
    return torch.tensor(ids[: count * seq_len], dtype=torch.int64).reshape(count, seq_len)


def kv_scales(
    checkpoint: Checkpoint,
    data: Path,
    *,
    seq_len: int = 512,
    max_sequences: int = 64,
    batch: int = 8,
    progress: Callable[[int], None] | None = None,
) -> KVScales:
    """Calibrate per-layer K/V scales on `data` (a text file). progress(layer) after each layer."""
    source = SourceLayers(checkpoint, "KV-cache calibration")
    from transformers import DynamicCache

    ids = calibration_ids(checkpoint, Path(data), seq_len, max_sequences)
    hidden = source.embed(ids)  # [N, T, H]
    positions = torch.arange(seq_len)[None]
    cos, sin = source.rotary(hidden[:1], positions)
    k_amax, v_amax = [], []
    with torch.inference_mode():
        for layer, module in source.layers(range(checkpoint.spec.num_hidden_layers)):
            k_max = v_max = torch.zeros((), dtype=torch.float32)
            for start in range(0, ids.shape[0], batch):
                cache = DynamicCache()
                h = hidden[start : start + batch]
                out = module(
                    h,
                    attention_mask=None,  # causal (no padding: whole sequences)
                    position_ids=positions.expand(h.shape[0], -1),
                    past_key_values=cache,
                    use_cache=True,
                    position_embeddings=(cos, sin),
                )
                hidden[start : start + batch] = out[0] if isinstance(out, tuple) else out
                k_max = torch.maximum(k_max, cache.layers[layer].keys.abs().max().float())
                v_max = torch.maximum(v_max, cache.layers[layer].values.abs().max().float())
            k_amax.append(float(k_max))
            v_amax.append(float(v_max))
            if progress is not None:
                progress(layer)
    digest = hashlib.sha256(Path(data).read_bytes()).hexdigest()
    return KVScales(
        tuple(_scale(a) for a in k_amax),
        tuple(_scale(a) for a in v_amax),
        int(ids.numel()),
        Path(data).name,
        digest,
    )


def _scale(amax: float) -> float:
    """amax / 448 rounded to fp32 (as a float32 tensor stores it); a zero amax gives scale 1."""
    return float(torch.tensor(amax / FP8_MAX if amax > 0 else 1.0, dtype=torch.float32))
