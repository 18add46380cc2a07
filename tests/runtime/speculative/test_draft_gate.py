"""The draft gate (engine/speculative/draft_gate.py): per batch bucket, plain steps measured first, then
drafting ones; drafting closes for a growing pause while it is measured slower than KEEP x plain,
and stays open where it pays. The gate in an engine: tests/runtime/test_speculative_engine.py."""

from __future__ import annotations

import math

import pytest
from qruntime import SpeculativeConfig
from qruntime.engine.speculative.draft_gate import (
    CLOSE_GROWTH,
    DRAFT_PROBE,
    FIRST_CLOSE,
    KEEP,
    MAX_CLOSE,
    PLAIN_PROBE,
    PROBE_SHARE,
    DraftGate,
    bucket_of,
)
from qruntime.engine.speculative.draft_length import StepClock


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 1, 2, 4, 4, 8, 8, 16, 64, 128]


def _gate() -> tuple[DraftGate, StepClock]:
    clock = StepClock()
    return DraftGate(clock), clock


def _plain(gate: DraftGate, batch: int, rate: float) -> None:
    for _ in range(PLAIN_PROBE):
        assert not gate.allows(batch)  # plain steps are measured first
        gate.record(batch, False, tokens=batch, seconds=batch / rate)


def test_plain_is_measured_first_then_drafting_until_judged():
    gate, _ = _gate()
    _plain(gate, 8, 1000.0)
    assert gate.rates(8) == (pytest.approx(1000.0), None)
    for _ in range(DRAFT_PROBE):
        assert gate.allows(8)  # measuring drafting
        gate.record(8, True, tokens=30, seconds=0.03 / 0.5)  # half plain's rate
    assert not gate.allows(8) and not gate.allows(5)  # 5 and 8 share a bucket
    assert gate.rates(8)[1] == pytest.approx(500.0)  # reported: the rate that closed it (measured afresh after)
    assert not gate.allows(1)  # another bucket: its own plain probe first
    _plain(gate, 1, 400.0)
    assert gate.allows(1)


def test_a_losing_bucket_closes_for_growing_pauses_and_reopens():
    gate, clock = _gate()
    _plain(gate, 4, 1000.0)
    closes = []
    for _ in range(5):
        while not gate.allows(4):
            clock.tick()
        opened = clock.now
        for _ in range(DRAFT_PROBE):
            assert gate.allows(4)
            gate.record(4, True, tokens=40, seconds=0.042)  # 952 tok/s: below KEEP x 1000, a probe loses little
        closed = clock.now
        while not gate.allows(4):
            clock.tick()
        closes.append(clock.now - closed)
        assert opened <= closed
    assert closes == [min(FIRST_CLOSE * CLOSE_GROWTH**i, MAX_CLOSE) for i in range(5)]
    assert closes[-1] == closes[-2] == MAX_CLOSE


def test_drafting_that_pays_stays_open_and_resets_the_pause():
    gate, clock = _gate()
    _plain(gate, 2, 1000.0)
    for _ in range(DRAFT_PROBE):
        gate.record(2, True, tokens=2, seconds=2 / 900.0)  # loses a little: closed for FIRST_CLOSE
    assert not gate.allows(2)
    for _ in range(FIRST_CLOSE):
        clock.tick()
    for _ in range(DRAFT_PROBE + 20):
        assert gate.allows(2)
        gate.record(2, True, tokens=8, seconds=8 / (KEEP * 1000.0 + 1))  # just above the bar
    assert gate.allows(2)
    for _ in range(DRAFT_PROBE + 10):  # it starts losing: closed again, for FIRST_CLOSE (reset), not 4x
        gate.record(2, True, tokens=2, seconds=2 / 900.0)
        if not gate.allows(2):
            break
    start = clock.now
    while not gate.allows(2):
        clock.tick()
    assert clock.now - start == FIRST_CLOSE


def test_a_bucket_losing_badly_pauses_until_its_probe_costs_a_small_share():
    """Plain: 8 tokens in 0.56 ms a step; drafting: 31 tokens in 5.2 ms (0.41x): a drafting step loses
    5.2 - 31 / 8 * 0.56 ms, DRAFT_PROBE of them ~9.3 ms, ~16 plain steps: the pause is the steps over
    which that is PROBE_SHARE of the time, not FIRST_CLOSE."""
    gate, clock = _gate()
    for _ in range(PLAIN_PROBE):
        gate.record(8, False, tokens=8, seconds=0.00056)
    for _ in range(DRAFT_PROBE):
        assert gate.allows(8)
        gate.record(8, True, tokens=31, seconds=0.0052)
    lost = DRAFT_PROBE * (0.0052 - 31 / 8 * 0.00056)
    want = math.ceil(lost / (PROBE_SHARE * 0.00056))
    assert want > 4 * FIRST_CLOSE
    start = clock.now
    while not gate.allows(8):
        clock.tick()
    assert clock.now - start == want
    gate2, clock2 = _gate()  # a loss past what MAX_CLOSE covers pauses for MAX_CLOSE
    for _ in range(PLAIN_PROBE):
        gate2.record(1, False, tokens=1, seconds=0.0001)
    for _ in range(DRAFT_PROBE):
        gate2.record(1, True, tokens=2, seconds=1.0)
    while not gate2.allows(1):
        clock2.tick()
    assert clock2.now == MAX_CLOSE


def test_a_modes_rate_is_its_tokens_over_its_seconds():
    """Two slow drafting steps (1 token in 10 ms) then a fast one (30 tokens in 1 ms): 32 tokens in 21
    ms is slower than plain's 3000 tok/s, though an average of the steps' own rates (100, 100, 30000
    tok/s) would put it at 7575."""
    gate, _ = _gate()
    _plain(gate, 1, 3000.0)
    for tokens, seconds in ((1, 0.01), (1, 0.01), (30, 0.001)):
        assert gate.allows(1)
        gate.record(1, True, tokens, seconds)
    assert not gate.allows(1)


def test_empty_samples_are_ignored():
    gate, _ = _gate()
    gate.record(1, False, tokens=0, seconds=0.01)
    gate.record(1, False, tokens=3, seconds=0.0)
    assert gate.rates(1) == (None, None) and not gate.allows(1)


def test_the_config_parses_the_gate():
    assert SpeculativeConfig.parse("prompt-lookup:gate=false").gate is False
    assert SpeculativeConfig.parse("prompt-lookup:gate=1").gate is True
    assert SpeculativeConfig().gate is None
