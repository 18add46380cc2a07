"""Adaptive draft length: how many tokens a request drafts next, from how its drafts fared.

Verifying k drafts costs a step of k + 1 positions instead of 1. At batch 1 a step reads all the
weights whatever its few positions, so a rejected draft costs little, but not nothing (attention,
the logits of k more rows, the host's proposal, a draft model's own steps, and a synchronous step
where the engine otherwise runs ahead): a request whose drafts are all accepted drafts one more
next time (up to the configured k), one that loses some drafts as many as were accepted plus one,
and one whose acceptance stays low (an exponential average below LOW_ACCEPTANCE) stops drafting
for a pause, then tries again. So does one whose proposer found nothing MISSES_TO_PAUSE times
running (prompt lookup on text that does not repeat): each search is host work a synchronous step
waits for, and while no request is due to draft the engine schedules asynchronously (engine.py).

The pauses bound what a draft that is never right costs (issue 19: no method slower than 0.95x
plain decoding): FIRST_PAUSE steps, each next one PAUSE_GROWTH times longer up to MAX_PAUSE, so
such a request verifies about log4(n) + n / MAX_PAUSE times in n tokens. A request starts, and
comes back from a pause, with an average of START_ACCEPTANCE: one verification that accepts
nothing pauses it again, one that accepts any draft keeps it drafting. Pauses are counted on the
engine's step clock (StepClock, one per Speculator) and end on a multiple of their length, so the
requests of a batch whose drafts keep failing try again in the same step: one synchronous step
for all of them instead of one each."""

from __future__ import annotations

from dataclasses import dataclass, field

LOW_ACCEPTANCE = 0.2  # below this averaged fraction of drafts accepted, drafting pauses
SMOOTHING = 0.5  # weight of the newest verification in the average
START_ACCEPTANCE = 0.3  # the average a request starts and resumes with: (1 - SMOOTHING) * 0.3 < LOW_ACCEPTANCE
FIRST_PAUSE = 4  # steps
PAUSE_GROWTH = 4  # powers of 4 from 4: each pause's multiples are multiples of the shorter ones
MAX_PAUSE = 256  # steps
MISSES_TO_PAUSE = 2  # proposals in a row that found no draft


@dataclass
class StepClock:
    """Engine steps so far (the Speculator ticks it once a scheduled step): what pauses count."""

    now: int = 0

    def tick(self) -> None:
        self.now += 1


@dataclass
class DraftLength:
    """One request's adaptive k (see the module docstring); fixed at `limit` when not adaptive."""

    limit: int
    adaptive: bool = True
    clock: StepClock = field(default_factory=StepClock)
    k: int = 0
    acceptance: float = START_ACCEPTANCE
    resume_at: int = 0  # the clock's step at which drafting resumes
    next_pause: int = FIRST_PAUSE
    misses: int = 0  # proposals in a row that found nothing

    def __post_init__(self) -> None:
        self.k = self.k or self.limit

    def wanted(self) -> int:
        """Drafts to propose this step (0 while paused)."""
        return self.k if self.due else 0

    @property
    def due(self) -> bool:
        """Whether the request drafts at this step (not paused)."""
        return self.clock.now >= self.resume_at

    def miss(self) -> None:
        """The proposer found no draft for it."""
        if not self.adaptive:
            return
        self.misses += 1
        if self.misses >= MISSES_TO_PAUSE:
            self.misses = 0
            self._pause()

    def record(self, proposed: int, accepted: int) -> None:
        """A verification of `proposed` drafts accepted `accepted` of them."""
        if not self.adaptive or proposed == 0:
            return
        self.misses = 0
        self.acceptance = (1 - SMOOTHING) * self.acceptance + SMOOTHING * accepted / proposed
        self.k = min(self.k + 1, self.limit) if accepted == proposed else max(accepted + 1, 1)
        if self.acceptance < LOW_ACCEPTANCE:
            self._pause()
            self.acceptance = START_ACCEPTANCE  # back from the pause with the benefit of the doubt, not a certainty
        elif accepted:
            self.next_pause = FIRST_PAUSE

    def _pause(self) -> None:
        """Stop drafting until a multiple of the next pause's length, half a length to one and a half
        away, and lengthen the pause after it."""
        length, now = self.next_pause, self.clock.now
        self.resume_at = ((now + length // 2) // length + 1) * length
        self.next_pause = min(length * PAUSE_GROWTH, MAX_PAUSE)
