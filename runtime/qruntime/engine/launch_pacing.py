"""Launch pacing: how long a server may hold the next asynchronous step so that requests arriving
meanwhile still join it, without leaving the device idle (plain Python: no torch).

With async scheduling the engine queues step N+1 while step N runs, then waits for N. A request that
arrives during that wait is added once N has ended, to step N+2, which the device starts only after
N+1: one whole step later than if N+1 had been scheduled after it arrived. Held until shortly
before the step in flight ends, the next launch takes such arrivals in. The hold is the step's
expected end, less the host time a launch takes and a margin.

Everything comes from measurement on the host clock:
- a step's device time runs from when the host saw the step before it end (or from its own launch,
  when that came later) to when the host saw it end, measured only when the host was already
  waiting for it (its read blocked): an end seen late says only that the step ended earlier;
- steps are keyed by their shape (tokens, prefill chunks and their context, each bucketed to a
  power of two) and a key's estimate is `safety` times the smaller of its last two durations, so a
  wrong estimate errs towards launching early, which is what happens without pacing;
- a launch's host time is the longest of the last `lead_window` launches' (from the end of a hold
  to the launch being queued, the arrivals' admission included): a launch that takes longer than
  expected leaves the device idle, one that takes less only waits on the step a little longer.
A step in flight whose shape has no measurement yet, or whose start is unknown, is not held.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

StepKey = tuple[int, int, int]


def bucket(n: int) -> int:
    """n rounded up to a power of two (0 stays 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def step_key(num_tokens: int, prefill_chunks: int, prefill_context: int) -> StepKey:
    """The shape a step's device time is estimated by: its tokens, its chunks of more than one
    token, and the positions those chunks attend to (in blocks of 256), each bucketed."""
    return bucket(num_tokens), bucket(prefill_chunks), bucket(-(-prefill_context // 256))


@dataclass(frozen=True)
class PacingConfig:
    """The pacer's margins (seconds unless named otherwise)."""

    safety: float = 0.85  # the fraction of a shape's shortest recent device time trusted as its next
    margin_s: float = 5e-4  # queue the next step this long before the estimated end, beyond the launch's host time
    min_hold_s: float = 3e-4  # shorter holds are not worth a wait
    max_hold_s: float = 0.05  # never hold longer (a step's estimate gone stale)
    blocked_s: float = 2e-4  # a read that took at least this long was waiting for its step
    lead_window: int = 16  # launches whose host times the next one is expected not to exceed

    def __post_init__(self) -> None:
        if not 0.0 < self.safety <= 1.0:
            raise ValueError(f"PacingConfig.safety must be in (0, 1], got {self.safety}")
        if self.lead_window < 1:
            raise ValueError(f"PacingConfig.lead_window must be >= 1, got {self.lead_window}")
        for name in ("margin_s", "min_hold_s", "max_hold_s", "blocked_s"):
            if getattr(self, name) < 0.0:
                raise ValueError(f"PacingConfig.{name} must be >= 0, got {getattr(self, name)}")


class LaunchPacer:
    """One engine's step timings and the hold they allow (see the module docstring). The engine
    reports each launch and each completion; the serving loop asks for a hold before its next turn."""

    def __init__(self, config: PacingConfig | None = None) -> None:
        self.config = config or PacingConfig()
        self._durations: dict[StepKey, tuple[float, float]] = {}  # the last two device times of each shape
        self._last_end: float | None = None  # when the host saw the last completed step end (None: unknown)
        self._leads: deque[float] = deque(maxlen=self.config.lead_window)  # the last launches' host times
        self._resume: float | None = None  # when the last hold ends (the next launch's host time starts)

    def hold(self, key: StepKey, queued_at: float, now: float) -> float:
        """Seconds the next launch may wait, the step in flight being of shape `key` and queued at
        `queued_at` (0.0 when it cannot be estimated)."""
        cfg = self.config
        self._resume = now
        durations = self._durations.get(key)
        if durations is None or self._last_end is None or not self._leads:
            return 0.0
        end = max(self._last_end, queued_at) + cfg.safety * min(durations)
        wait = end - max(self._leads) - cfg.margin_s - now
        if wait < cfg.min_hold_s:
            return 0.0
        wait = min(wait, cfg.max_hold_s)
        self._resume = now + wait
        return wait

    def launched(self, started_at: float, queued_at: float) -> None:
        """A step was queued at `queued_at`; its host work began at `started_at` (or when the last
        hold ended, when one was asked for since the last launch)."""
        start = self._resume if self._resume is not None else started_at
        self._resume = None
        self._leads.append(max(queued_at - start, 0.0))

    def completed(self, key: StepKey, queued_at: float, read_at: float, seen_at: float) -> None:
        """The host began reading a step of shape `key` (queued at `queued_at`) at `read_at` and had
        its results at `seen_at`."""
        if seen_at - read_at < self.config.blocked_s:  # it had ended already: when, unknown
            self._last_end = None
            return
        if self._last_end is not None:
            duration = seen_at - max(self._last_end, queued_at)
            if duration > 0.0:
                last = self._durations.get(key)
                self._durations[key] = (duration, duration) if last is None else (last[1], duration)
        self._last_end = seen_at

    def estimate(self, key: StepKey) -> float | None:
        """The device time expected of a step of shape `key` (None: not measured yet)."""
        durations = self._durations.get(key)
        return None if durations is None else self.config.safety * min(durations)
