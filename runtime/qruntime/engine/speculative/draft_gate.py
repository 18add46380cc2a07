"""DraftGate: drafting only at the batch sizes where it is measured to pay.

A step in which some request may draft runs synchronously (the draft starts from the newest token,
which the host must have read), while plain decoding launches its next step before reading the last.
Whether drafting pays for that depends on the model, the GPU and the batch: on the bench's trained
104M target (H200, ac7551a, bench/results/spec_bench_trained_ac7551a_h200.json) prompt lookup gained
1.26-1.74x at batch 1 and every method lost 30-50% at batch 8, where plain decoding emits a token
a request every 0.5 ms. Per-request pauses (draft_length.py) do not see that: the drafts were right.

So the engine measures it. Per batch-size bucket (the next power of two of the running requests),
the gate keeps exponential averages of the tokens and of the seconds of the engine's drafting steps
and of its plain ones (steps with no prefill in them: Engine.step reports them); a mode's rate is
its average tokens over its average seconds, the aggregate rate, which an average of each step's
own tokens/s is not (db0a761, H200: that average put prompt lookup's drafting at batch 8 at 1.24x
plain, while the cell ran at 0.91x). A bucket first
measures PLAIN_PROBE plain steps, then DRAFT_PROBE drafting ones; drafting then goes on while its
rate is at least KEEP times plain's. Below that the bucket closes for a pause, measured on the
engine's step clock and longer each time it closes again (FIRST_CLOSE steps, times CLOSE_GROWTH,
up to MAX_CLOSE), and never shorter than what keeps the next probe's loss within PROBE_SHARE of the
pause. A draft model drafting at 0.41x plain's rate at batch 8 (64b5af2, H200: 3.84 tokens a
request in 5.2 ms, against 0.56 ms a plain step) loses ~16 plain steps' time a probe: after a pause
of 64 steps that is a quarter of the pause, and a bench pass of 128 steps in which such a probe
fell ran 18% below plain. Plain steps meanwhile keep plain's average current, and after the pause
DRAFT_PROBE drafting steps measure again. A bucket where drafting keeps paying never closes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qruntime.engine.speculative.draft_length import StepClock

PLAIN_PROBE = 4  # plain steps a bucket measures before its first drafting step
DRAFT_PROBE = 3  # drafting steps measured before (and after each pause) drafting is judged
KEEP = 0.97  # drafting goes on while its tokens/s is at least this share of plain decoding's
SMOOTHING = 0.25  # weight of the newest step in an average
FIRST_CLOSE = 64  # steps
CLOSE_GROWTH = 4
MAX_CLOSE = 4096  # steps
# a closed bucket's next probe costs at most this share of the time it stays closed: the pause is at
# least the probe's lost time over this share of a plain step (a draft that loses badly probes rarely)
PROBE_SHARE = 0.03


def bucket_of(batch: int) -> int:
    """The gate's bucket of `batch` running requests: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass
class _Average:
    """Exponential averages of a mode's step tokens and seconds (None before a sample)."""

    tokens: float | None = None
    seconds: float | None = None

    def add(self, tokens: int, seconds: float) -> None:
        if self.tokens is None or self.seconds is None:
            self.tokens, self.seconds = float(tokens), seconds
        else:
            self.tokens = (1 - SMOOTHING) * self.tokens + SMOOTHING * tokens
            self.seconds = (1 - SMOOTHING) * self.seconds + SMOOTHING * seconds

    @property
    def rate(self) -> float | None:
        """Tokens per second (None before a sample)."""
        return None if self.tokens is None or self.seconds is None else self.tokens / self.seconds


@dataclass
class _Rates:
    """One bucket's averages and sample counts, and its pause."""

    plain: _Average = field(default_factory=_Average)
    drafting: _Average = field(default_factory=_Average)
    plain_steps: int = 0
    drafting_steps: int = 0  # since the last judgement (reset when the bucket closes)
    closed_until: int = 0  # the step clock's value at which drafting may resume
    next_close: int = FIRST_CLOSE
    judged: float | None = None  # the drafting rate of the last judgement that closed the bucket (reports)


@dataclass
class DraftGate:
    """The engine's gate (see the module docstring); `clock` is the speculator's step clock."""

    clock: StepClock = field(default_factory=StepClock)
    _buckets: dict[int, _Rates] = field(default_factory=dict)

    def allows(self, batch: int) -> bool:
        """Whether a step of `batch` running requests may draft."""
        rates = self._buckets.setdefault(bucket_of(batch), _Rates())
        if self.clock.now < rates.closed_until or rates.plain_steps < PLAIN_PROBE:
            return False
        return rates.drafting_steps < DRAFT_PROBE or self._pays(rates)

    def record(self, batch: int, drafting: bool, tokens: int, seconds: float) -> None:
        """A step of `batch` running requests (drafting or plain) emitted `tokens` in `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        rates = self._buckets.setdefault(bucket_of(batch), _Rates())
        if drafting:
            rates.drafting.add(tokens, seconds)
            rates.drafting_steps += 1
            if rates.drafting_steps >= DRAFT_PROBE and not self._pays(rates):
                rates.judged = rates.drafting.rate
                pause = min(max(rates.next_close, _probe_cost_steps(rates)), MAX_CLOSE)
                rates.closed_until = self.clock.now + pause
                rates.next_close = min(rates.next_close * CLOSE_GROWTH, MAX_CLOSE)
                rates.drafting, rates.drafting_steps = _Average(), 0  # measured afresh after the pause
            elif rates.drafting_steps >= DRAFT_PROBE:
                rates.next_close = FIRST_CLOSE
        else:
            rates.plain.add(tokens, seconds)
            rates.plain_steps += 1

    def rates(self, batch: int) -> tuple[float | None, float | None]:
        """(plain, drafting) tokens/s averaged for `batch`'s bucket (None: not measured); while the
        bucket is closed, or until it is measured again after, drafting's is the rate that closed it."""
        rates = self._buckets.get(bucket_of(batch), _Rates())
        drafting = rates.drafting.rate
        return rates.plain.rate, rates.judged if drafting is None else drafting

    @staticmethod
    def _pays(rates: _Rates) -> bool:
        plain, drafting = rates.plain.rate, rates.drafting.rate
        return plain is None or drafting is None or drafting >= KEEP * plain


def _probe_cost_steps(rates: _Rates) -> int:
    """The pause, in plain steps, over which DRAFT_PROBE drafting steps like the averaged ones lose at
    most PROBE_SHARE of the time: each loses its seconds less what plain steps take for its tokens."""
    plain, drafting = rates.plain, rates.drafting
    if not (plain.tokens and plain.seconds and drafting.tokens and drafting.seconds):
        return 0
    lost = drafting.seconds - drafting.tokens / plain.tokens * plain.seconds
    return math.ceil(DRAFT_PROBE * max(lost, 0.0) / (PROBE_SHARE * plain.seconds))
