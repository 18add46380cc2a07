"""Speculator: what a speculating engine holds — the configured draft method, each request's adaptive
draft length, and the counts /metrics and the benchmarks report."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qruntime.engine.sampling_params import SamplingParams
from qruntime.engine.speculative.config import SpeculativeConfig
from qruntime.engine.speculative.draft import Draft, DraftFor, ProposerContext
from qruntime.engine.speculative.draft_gate import DraftGate
from qruntime.engine.speculative.draft_length import DraftLength, StepClock
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
    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None, gate: bool = False) -> None:
        """gate: drafting only at the batch sizes where it is measured to pay (draft_gate.py; never
        without config.adaptive)."""
        self.config = config
        self.proposer = PROPOSERS[config.method](config, context)
        self.stats = SpeculativeStats()
        self._lengths: dict[str, DraftLength] = {}
        self._clock = StepClock()  # the steps each request's drafting pause counts
        self.gate = DraftGate(self._clock) if gate and config.adaptive else None
        self._probs: dict[str, torch.Tensor] = {}  # request id -> its pending draft's distributions [k, V]
        self._ahead: dict[str, Draft] = {}  # drafts made before the step was scheduled (draft_ahead)

    @property
    def batches(self) -> bool:
        """Whether the method drafts for every decoding request at once (draft_ahead), in shared steps."""
        return bool(getattr(self.proposer, "batches", False))

    def draft_ahead(
        self,
        items: Sequence[
            tuple[str, Sequence[int], int, SamplingParams, torch.Generator | None, Callable[[int], Any] | None]
        ],
    ) -> None:
        """Draft, in one batch, for the requests (id, token ids, limit, params, generator, grow) a step
        may give drafts, each up to its adaptive k and `limit`; `draft` hands them out as the
        scheduler asks (cut to what the step's budget leaves). grow: DraftFor.grow, for a draft that
        writes the target's KV cache. Drafts not asked for this step are dropped at the next call."""
        todo = []
        for request_id, token_ids, limit, params, generator, grow in items:
            length = self._lengths.get(request_id)
            if length is None:
                length = self._lengths[request_id] = self._length()
            k = min(length.wanted(), limit)
            if k >= 1:
                todo.append((token_ids, k, DraftFor(request_id, params, generator, grow)))
        drafts = self.proposer.propose_batch(todo) if todo else []
        self._ahead = {request.request_id: d for (_, _, request), d in zip(todo, drafts, strict=True)}

    def draft(
        self,
        request_id: str,
        token_ids: Sequence[int],
        limit: int,
        params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
        grow: Callable[[int], tuple[int, ...] | None] | None = None,
    ) -> tuple[int, ...]:
        """The request's drafts for this step: at most `limit` (what its budget, max_tokens and the
        model length leave) and its adaptive k. Their distributions, when the method draws them,
        wait in `probs` for the verification."""
        self._probs.pop(request_id, None)
        draft = self._ahead.pop(request_id, None)
        if draft is not None:
            k = limit
        else:
            length = self._lengths.get(request_id)
            if length is None:
                length = self._lengths[request_id] = self._length()
            k = min(length.wanted(), limit)
            if k < 1:
                return ()
            draft = self.proposer.propose(
                token_ids, k, DraftFor(request_id, params or SamplingParams(), generator, grow)
            )
        if not isinstance(draft, Draft):
            draft = Draft(tuple(draft))
        tokens = draft.tokens[:k]
        if not tokens and k >= 1 and (length := self._lengths.get(request_id)) is not None:
            length.miss()
        if draft.probs is not None and tokens:
            self._probs[request_id] = draft.probs[: len(tokens)]
        return tokens

    def due(self, request_id: str) -> bool:
        """Whether the request would be asked for drafts at its next step (not paused; a request not
        seen yet is)."""
        length = self._lengths.get(request_id)
        return length is None or length.due

    def allows(self, batch: int) -> bool:
        """Whether a step of `batch` running requests may draft (the gate's verdict; always without one)."""
        return self.gate is None or self.gate.allows(batch)

    def measured(self, batch: int, drafting: bool, tokens: int, seconds: float) -> None:
        """A step without prefill of `batch` running requests, drafting or not, emitted `tokens` in
        `seconds` (for the gate)."""
        if self.gate is not None:
            self.gate.record(batch, drafting, tokens, seconds)

    def tick(self) -> None:
        """A step was scheduled (drafting or not): every request's pause counts it."""
        self._clock.tick()

    def probs(self, request_id: str) -> torch.Tensor | None:
        """The distributions [k, V] the request's last drafts were drawn from (None: a point mass, or
        greedy)."""
        return self._probs.get(request_id)

    def record(self, request_id: str, drafted: int, accepted: int, emitted: int) -> None:
        """A verification's outcome (emitted: the tokens the request kept from the step, after stops)."""
        self.stats = self.stats.add(drafted, accepted, emitted)
        length = self._lengths.get(request_id)
        if length is not None:
            length.record(drafted, accepted)

    def _length(self) -> DraftLength:
        """A new request's draft length, on this engine's step clock."""
        return DraftLength(self.config.num_tokens, self.config.adaptive, self._clock)

    def attach(self, runner: Any) -> None:
        """Give the proposer the target's model runner (the engine does, once built)."""
        self.proposer.attach(runner)

    def has_idle_work(self) -> bool:
        return self.proposer.has_idle_work()

    def idle_work(self) -> bool:
        """One piece of the proposer's start-up work (Proposer.idle_work); whether any is left."""
        return self.proposer.idle_work()

    def close(self) -> None:
        """Release what the proposer holds (a draft model's engine)."""
        self.proposer.close()

    def forget(self, request_id: str) -> None:
        """The request finished: drop its state."""
        self._lengths.pop(request_id, None)
        self._probs.pop(request_id, None)
        self._ahead.pop(request_id, None)
        self.proposer.forget(request_id)
