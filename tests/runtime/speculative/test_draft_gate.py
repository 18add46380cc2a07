"""The draft gate (engine/speculative/draft_gate.py): per batch bucket, plain steps measured first, then
drafting ones; drafting closes for a growing pause while it is measured slower than KEEP x plain,
and stays open where it pays. Then in an engine (CPU, fp32): the steps it measures, and a closed
bucket's steps run without drafts and still give plain greedy outputs."""

from __future__ import annotations

import random

import pytest
import qruntime
import torch
from qruntime import SamplingParams, SpeculativeConfig
from qruntime.engine.speculative.draft_gate import (
    CLOSE_GROWTH,
    DRAFT_PROBE,
    FIRST_CLOSE,
    KEEP,
    MAX_CLOSE,
    PLAIN_PROBE,
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
    assert gate.rates(8)[1] is None  # measured afresh after the pause
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
            gate.record(4, True, tokens=40, seconds=0.05)  # 800 tok/s: below KEEP x 1000
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
        gate.record(2, True, tokens=2, seconds=2 / 400.0)  # loses: closed for FIRST_CLOSE
    assert not gate.allows(2)
    for _ in range(FIRST_CLOSE):
        clock.tick()
    for _ in range(DRAFT_PROBE + 20):
        assert gate.allows(2)
        gate.record(2, True, tokens=8, seconds=8 / (KEEP * 1000.0 + 1))  # just above the bar
    assert gate.allows(2)
    for _ in range(DRAFT_PROBE + 10):  # it starts losing: closed again, for FIRST_CLOSE (reset), not 4x
        gate.record(2, True, tokens=2, seconds=2 / 100.0)
        if not gate.allows(2):
            break
    start = clock.now
    while not gate.allows(2):
        clock.tick()
    assert clock.now - start == FIRST_CLOSE


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


# ---- in an engine ----


@pytest.fixture(scope="module")
def artifact(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "bf16")


def _engine(artifact, speculative=None):
    return qruntime.load(artifact, device="cpu", dtype=torch.float32, speculative=speculative, num_kv_blocks=128)


def _prompts(rng: random.Random, count: int) -> list[list[int]]:
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(40) for _ in range(rng.randrange(3, 8))]
        prompts.append((phrase * 6)[: rng.randrange(12, 30)])
    return prompts


def test_on_a_cpu_the_gate_is_off_unless_asked(artifact):
    assert _engine(artifact, SpeculativeConfig()).speculator.gate is None
    assert _engine(artifact, SpeculativeConfig(gate=True, adaptive=False)).speculator.gate is None
    assert _engine(artifact, SpeculativeConfig(gate=True)).speculator.gate is not None


def test_an_engine_measures_its_steps_and_a_closed_bucket_decodes_plainly(artifact, rng):
    prompts = _prompts(rng, 3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in _engine(artifact).generate(prompts, params)]
    engine = _engine(artifact, SpeculativeConfig(gate=True, prompt_lookup_min=1))
    gate = engine.speculator.gate
    out = [o.token_ids for o in engine.generate(prompts, params)]
    assert out == plain
    plain_rate, drafting_rate = gate.rates(3)
    assert plain_rate is not None and plain_rate > 0, "the plain probe steps were measured"
    verified = engine.speculative_stats.verifications
    # drafting in bucket 4 measured at a tenth of plain's rate, from now on: closed at once
    for _ in range(DRAFT_PROBE):
        gate.record(3, True, tokens=1, seconds=10 / plain_rate)
    assert not gate.allows(3)
    out = [o.token_ids for o in engine.generate(prompts, params)]
    assert out == plain
    # the prompts' prefill steps are not measured; the closed bucket drafted nothing (FIRST_CLOSE > 24 steps)
    assert engine.speculative_stats.verifications == verified
    assert FIRST_CLOSE > 24


def test_calls_that_admit_a_request_or_read_its_prefill_are_not_measured(artifact, rng):
    """Two requests decode; a third arrives at call ADD: that call admits it (its prefill is in the
    step it launches) and the next reads that step, so neither is a sample; the calls around them are."""
    engine = _engine(artifact, SpeculativeConfig(gate=True, prompt_lookup_min=1))
    samples, calls, measured = [], [0], engine.speculator.measured

    def spy(batch, drafting, tokens, seconds):
        samples.append((calls[0], batch))
        measured(batch, drafting, tokens, seconds)

    engine.speculator.measured = spy
    prompts, params = _prompts(rng, 3), SamplingParams(max_tokens=30, ignore_eos=True)
    for prompt in prompts[:2]:
        engine.add_request(prompt, params)
    add = 10
    while engine.scheduler.has_unfinished():
        calls[0] += 1
        if calls[0] == add:
            engine.add_request(prompts[2], params)
        engine.step()
    at = dict(samples)
    print("samples (call, batch):", samples)
    assert 1 not in at and 2 not in at  # the first prefill: admitted at call 1, read at 1 or 2
    assert add not in at and add + 1 not in at
    assert any(call < add and batch == 2 for call, batch in samples)
    assert any(call > add + 1 and batch == 3 for call, batch in samples)
