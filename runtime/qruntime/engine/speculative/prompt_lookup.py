"""prompt-lookup: the n-gram of the last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
is looked for earlier in the sequence, latest match first, and the tokens that followed it are the
draft. No model: it pays where the output repeats its prompt (editing code, quoting, extraction)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qruntime.engine.speculative.draft import DraftFor


class PromptLookup:
    """The n-gram proposer (see the module docstring). Matching is vectorized over the sequence:
    O(len · n) numpy work per call, no Python loop over positions."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Sequence[int], k: int, request: DraftFor | None = None) -> tuple[int, ...]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if k < 1 or length < self.min_n + 1:
            return ()
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # windows starting at 0 .. length - n - 1: every n-gram but the suffix itself
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                after = int(hits[-1]) + n  # the token that followed the latest earlier match
                return tuple(tokens[after : after + k].tolist())
        return ()

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def close(self) -> None:
        """Nothing is held."""

    def attach(self, runner: object) -> None:
        """No model."""
