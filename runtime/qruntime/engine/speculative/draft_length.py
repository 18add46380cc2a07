"""Adaptive draft length: how many tokens a request drafts next, from how its drafts fared.

Verifying k drafts costs a step of k + 1 positions instead of 1. At batch 1 a step reads all the
weights whatever its few positions, so a rejected draft costs little, but not nothing (attention,
the logits of k more rows, the host's proposal): a request whose drafts are all accepted drafts
one more next time (up to the configured k), one that loses some drafts as many as were accepted
plus one, and one whose acceptance stays low (an exponential average below LOW_ACCEPTANCE) stops
drafting for a pause that doubles each time (up to MAX_PAUSE steps), then tries again. So does one
whose proposer found nothing MISSES_TO_PAUSE times running (prompt lookup on text that does not
repeat): each search is host work a synchronous step waits for, and while every request pauses the
engine schedules asynchronously (engine.py)."""

from __future__ import annotations

from dataclasses import dataclass

LOW_ACCEPTANCE = 0.2  # below this averaged fraction of drafts accepted, drafting pauses
SMOOTHING = 0.5  # weight of the newest verification in the average
MAX_PAUSE = 64  # steps
MISSES_TO_PAUSE = 2  # proposals in a row that found no draft


@dataclass
class DraftLength:
    """One request's adaptive k (see the module docstring); fixed at `limit` when not adaptive."""

    limit: int
    adaptive: bool = True
    k: int = 0
    acceptance: float = 1.0
    pause: int = 0  # steps left without drafting
    next_pause: int = 4
    misses: int = 0  # proposals in a row that found nothing

    def __post_init__(self) -> None:
        self.k = self.k or self.limit

    def wanted(self) -> int:
        """Drafts to propose this step (0 while paused; counts the paused step)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.k

    @property
    def due(self) -> bool:
        """Whether the request drafts at its next step (not paused)."""
        return self.pause == 0

    def skip(self) -> None:
        """A step the request ran without being asked for drafts (asynchronous): counts a paused step."""
        self.pause = max(self.pause - 1, 0)

    def miss(self) -> None:
        """The proposer found no draft for it."""
        if not self.adaptive:
            return
        self.misses += 1
        if self.misses >= MISSES_TO_PAUSE:
            self.misses = 0
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, MAX_PAUSE)

    def record(self, proposed: int, accepted: int) -> None:
        """A verification of `proposed` drafts accepted `accepted` of them."""
        if not self.adaptive or proposed == 0:
            return
        self.misses = 0
        self.acceptance = (1 - SMOOTHING) * self.acceptance + SMOOTHING * accepted / proposed
        self.k = min(self.k + 1, self.limit) if accepted == proposed else max(accepted + 1, 1)
        if self.acceptance < LOW_ACCEPTANCE:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, MAX_PAUSE)
            self.acceptance = 0.5  # back from the pause with the benefit of the doubt, not a certainty
        elif accepted:
            self.next_pause = 4
