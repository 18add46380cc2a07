"""One step's sampled token ids, kept on the device for the next step and read by the host later.

Async scheduling runs step N+1 before the host knows what step N sampled: N+1's decode rows name
N's tokens by row (step_chunk.pending) and `resolve_pending` swaps them in on the device, while the
host copy of N's tokens lands in pinned memory for `tolist()` to read once it has arrived.
"""

from __future__ import annotations

import math

import torch


class SampledTokens:
    """Token ids [n] on the device now; `tolist()` gives them on the host (None for a row whose logits
    were not finite: its `peaks` entry, the row's maximum logit, is NaN or inf), waiting for their
    copy alone, not for work queued after it."""

    def __init__(self, ids: torch.Tensor, peaks: torch.Tensor) -> None:
        self.ids = ids  # int64 [n] on the device: what the next step reads
        pin = ids.is_cuda
        self._ids_host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=pin)
        self._peaks_host = torch.empty(peaks.shape, dtype=peaks.dtype, pin_memory=pin)
        self._ids_host.copy_(ids, non_blocking=pin)
        self._peaks_host.copy_(peaks, non_blocking=pin)
        self._copied = torch.cuda.Event() if pin else None
        if self._copied is not None:
            self._copied.record()
        self._known: list[int | None] | None = None

    def tolist(self) -> list[int | None]:
        if self._known is None:
            if self._copied is not None:
                self._copied.synchronize()
            peaks, ids = self._peaks_host.tolist(), self._ids_host.tolist()
            self._known = [i if math.isfinite(p) else None for i, p in zip(ids, peaks, strict=True)]
        return self._known


def resolve_pending(input_ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """input_ids with each pending id (step_chunk.pending(row): -1 - row) replaced by sampled[row],
    on the device, with no host sync. Real ids (>= 0) pass through."""
    rows = (-1 - input_ids).clamp_(min=0)
    return torch.where(input_ids < 0, sampled[rows], input_ids)
