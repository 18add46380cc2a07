"""Draft methods, by name. A proposer sees a request's tokens (prompt then outputs) and proposes up
to k next tokens, deterministically: a point mass, which rejection.verify_drafts accepts with the
target's probability of each token.

prompt-lookup: the n-gram of the last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
is looked for earlier in the sequence, latest match first, and the tokens that followed it are the
draft. No model: it pays where the output repeats its prompt (editing code, quoting, extraction)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import numpy as np


class ProposerOptions(Protocol):
    """What a proposer is built from (a config.SpeculativeConfig)."""

    prompt_lookup_min: int
    prompt_lookup_max: int


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
        """At most k draft tokens to follow token_ids (none: no guess worth verifying)."""
        ...


class PromptLookup:
    """The n-gram proposer (see the module docstring). Matching is vectorized over the sequence:
    O(len · n) numpy work per call, no Python loop over positions."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
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


def _prompt_lookup(config: ProposerOptions) -> Proposer:
    return PromptLookup(config.prompt_lookup_min, config.prompt_lookup_max)


# method name -> builder from the config (read-only: no module-level mutable state)
PROPOSERS: Mapping[str, Callable[[ProposerOptions], Proposer]] = MappingProxyType({"prompt-lookup": _prompt_lookup})
