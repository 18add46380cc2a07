"""Speculator: what a speculating engine holds — the configured draft method, each request's adaptive
draft length, and the counts /metrics and the benchmarks report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qruntime.engine.speculative.config import SpeculativeConfig
from qruntime.engine.speculative.draft_length import DraftLength
from qruntime.engine.speculative.proposers import PROPOSERS


@dataclass(frozen=True)
class SpeculativeStats:
    """Since the engine started: draft tokens proposed and accepted, verifications (a request's
    drafts checked in one step) and the tokens they emitted (accepted drafts plus the token each
    verification adds). An immutable value: safe to read from another thread."""

    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verification(self) -> float:
        """Mean tokens a verified request got from its step (1 + accepted drafts; 0 before any)."""
        return self.emitted / self.verifications if self.verifications else 0.0

    def add(self, drafted: int, accepted: int, emitted: int) -> SpeculativeStats:
        return SpeculativeStats(
            self.drafted + drafted, self.accepted + accepted, self.verifications + 1, self.emitted + emitted
        )


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = PROPOSERS[config.method](config)
        self.stats = SpeculativeStats()
        self._lengths: dict[str, DraftLength] = {}

    def draft(self, request_id: str, token_ids: Sequence[int], limit: int) -> tuple[int, ...]:
        """The request's drafts for this step: at most `limit` (what its budget, max_tokens and the
        model length leave) and its adaptive k."""
        length = self._lengths.get(request_id)
        if length is None:
            length = self._lengths[request_id] = DraftLength(self.config.num_tokens, self.config.adaptive)
        k = min(length.wanted(), limit)
        return self.proposer.propose(token_ids, k) if k > 0 else ()

    def record(self, request_id: str, drafted: int, accepted: int, emitted: int) -> None:
        """A verification's outcome (emitted: the tokens the request kept from the step, after stops)."""
        self.stats = self.stats.add(drafted, accepted, emitted)
        length = self._lengths.get(request_id)
        if length is not None:
            length.record(drafted, accepted)

    def forget(self, request_id: str) -> None:
        """The request finished: drop its state."""
        self._lengths.pop(request_id, None)
