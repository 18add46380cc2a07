"""prompt-lookup: the n-gram of the last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
is looked for earlier in the sequence, latest match first, and the tokens that followed it are the
draft. No model: it pays where the output repeats its prompt (editing code, quoting, extraction).

Each request keeps an index of its n-grams (n-gram -> its latest start), grown by the tokens
appended since its last draft, so a draft costs a few dict operations per n whatever the sequence's
length. Searching the whole sequence each step (numpy over every window) cost ~0.11-0.13 ms per
request per step on the H200 machine's CPU at 128-384 tokens, which a synchronous speculating step
adds to every token (bench/spec_step_profile.py)."""

from __future__ import annotations

from collections.abc import Sequence

from qruntime.engine.speculative.draft import DraftFor


class NGramIndex:
    """One sequence's n-grams of lengths min_n..max_n: for each, the latest start among those that end
    before the sequence's last token (every n-gram but the suffix itself and what overlaps its end)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def follows(self, token_ids: Sequence[int]) -> bool:
        """Whether token_ids extends the indexed sequence (checked at its length and last token: a
        request's tokens only grow)."""
        known = len(self.tokens)
        return len(token_ids) >= known and (known == 0 or token_ids[known - 1] == self.tokens[-1])

    def extend(self, token_ids: Sequence[int]) -> None:
        """Index the tokens of token_ids past the indexed ones (token_ids must follow them)."""
        old = len(self.tokens)
        self.tokens.extend(token_ids[old:])
        tokens, end = self.tokens, len(self.tokens) - 1  # n-grams must end before the last token
        for n, starts in self.starts.items():
            for s in range(max(0, old - n), end - n + 1):
                starts[tuple(tokens[s : s + n])] = s

    def lookup(self, k: int) -> tuple[int, ...]:
        """Up to k tokens after the latest earlier match of the longest n-gram ending the sequence."""
        tokens, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            s = self.starts[n].get(tuple(tokens[length - n :]))
            if s is not None:
                return tuple(tokens[s + n : s + n + k])
        return ()


class PromptLookup:
    """The n-gram proposer (see the module docstring): an NGramIndex per request (a call without a
    request indexes its tokens afresh)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NGramIndex] = {}

    def propose(self, token_ids: Sequence[int], k: int, request: DraftFor | None = None) -> tuple[int, ...]:
        if k < 1 or len(token_ids) < self.min_n + 1:
            return ()
        index = self._indexes.get(request.request_id) if request is not None else None
        if index is None or not index.follows(token_ids):
            index = NGramIndex(self.min_n, self.max_n)
            if request is not None:
                self._indexes[request.request_id] = index
        index.extend(token_ids)
        return index.lookup(k)

    def forget(self, request_id: str) -> None:
        """Drop the request's index."""
        self._indexes.pop(request_id, None)

    def close(self) -> None:
        """Drop every index."""
        self._indexes.clear()

    def attach(self, runner: object) -> None:
        """No model."""

    def has_idle_work(self) -> bool:
        return False

    def idle_work(self) -> bool:
        return False
