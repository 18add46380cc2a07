"""Row layouts of a step's token inputs that ModelRunner.prepare and the mixed graphs' host buffers
(mixed_inputs.py) both build: the M-RoPE positions of a Qwen3-VL step and the rows whose logits come
back."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qruntime.engine.step_chunk import StepChunk


def mrope_rows(chunks: Sequence[StepChunk], positions: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """positions [3, T]: each token's position on all three axes, but a chunk's own M-RoPE rows where
    it carries them (a request with images)."""
    rows = np.repeat(positions[None], 3, axis=0)
    for b, chunk in enumerate(chunks):
        if chunk.mrope is not None:
            rows[:, starts[b] : starts[b + 1]] = chunk.mrope
    return rows


def logit_rows(all_logits: bool | Sequence[bool], lens: np.ndarray, starts: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """The step's token rows whose logits come back: each chunk's last, every row with all_logits, or
    with one bool per chunk every row of the chunks it marks and the last of the others."""
    tokens = int(starts[-1])
    if all_logits is True:
        return np.arange(tokens)
    if all_logits is False:
        return starts[1:] - 1
    every = np.asarray(all_logits, dtype=bool)
    if every.shape != lens.shape:
        raise ValueError(f"all_logits has {every.size} entries for {lens.size} chunks")
    last = np.zeros(tokens, dtype=bool)
    last[starts[1:] - 1] = True
    return np.flatnonzero(every[seq] | last)
