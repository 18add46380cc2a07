"""The engine loop's launch pacing (EngineLoop pace_launches, Engine.launch_hold): the loop waits the
hold the engine allows before its next turn, a request submitted meanwhile joins the step launched
right after it, a stop ends the wait at once, and the engine measures its steps by their shapes."""

from __future__ import annotations

import argparse
import random
import threading
import time

import pytest
import qruntime
from qruntime import SamplingParams
from qruntime.engine.launch_pacing import step_key
from qruntime.serve.engine_loop import EngineLoop, Submission
from qruntime.serve.options import add_serve_parser, serve_options_from
from qruntime.serve.protocol import SequenceSpec


@pytest.fixture(scope="module")
def artifact(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


@pytest.fixture
def engine(artifact):
    return qruntime.load(artifact, device="cpu", num_kv_blocks=64)


def _submission(name: str, rng: random.Random, max_tokens: int) -> Submission:
    prompt = tuple(rng.randrange(1, 500) for _ in range(rng.randrange(3, 30)))
    spec = SequenceSpec(0, 0, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return Submission(name, (spec,), time.perf_counter())


class _Recorder:
    """Wraps engine.step and engine.launch_hold: the requests the engine knows at each step() call, and
    one long hold after the first step, signalled to the test."""

    def __init__(self, engine, hold_s: float) -> None:
        self.engine, self.hold_s = engine, hold_s
        self.steps: list[tuple[float, set[str]]] = []
        self.holding = threading.Event()
        self.held_at: float | None = None
        step, hold = engine.step, engine.launch_hold
        engine.step = self._step
        engine.launch_hold = self._hold
        self._step_fn, self._hold_fn = step, hold

    def _step(self):
        self.steps.append((time.perf_counter(), set(self.engine._tracked)))
        return self._step_fn()

    def _hold(self) -> float:
        assert self._hold_fn() == 0.0  # on a CPU every read finds its step done: nothing is held
        if self.held_at is None and self.steps:
            self.held_at = time.perf_counter()
            self.holding.set()
            return self.hold_s
        return 0.0


def _run_loop(engine, hold_s: float, pace: bool | None):
    done = threading.Event()
    finished: list[str] = []

    def sink(items, ended):
        finished.extend(ended)
        if len(finished) == 2:
            done.set()

    recorder = _Recorder(engine, hold_s)
    loop = EngineLoop(engine, sink, **({} if pace is None else {"pace_launches": pace}))
    return loop, recorder, done


def test_a_request_submitted_during_a_hold_joins_the_next_step(engine, rng):
    loop, recorder, done = _run_loop(engine, 1.0, pace=True)
    loop.start()
    try:
        loop.submit(_submission("a", rng, 12))
        assert recorder.holding.wait(30)
        time.sleep(0.05)  # well inside the hold
        loop.submit(_submission("b", rng, 4))
        assert done.wait(60)
    finally:
        loop.stop(10)
    after = [(t, ids) for t, ids in recorder.steps if t >= recorder.held_at]
    # the first turn after the hold: it waited the hold out, and b is in the engine by then
    assert after[0][0] - recorder.held_at >= 1.0 - 1e-3
    assert "b-0" in after[0][1]
    # before the hold nobody knew of b
    assert all("b-0" not in ids for t, ids in recorder.steps if t < recorder.held_at)


def test_by_default_the_loop_never_waits(engine, rng):
    loop, recorder, done = _run_loop(engine, 30.0, pace=None)
    loop.start()
    try:
        loop.submit(_submission("a", rng, 6))
        loop.submit(_submission("b", rng, 6))
        assert done.wait(60)
    finally:
        loop.stop(10)
    assert recorder.held_at is None  # launch_hold was never asked


def test_stop_ends_a_hold_at_once(engine, rng):
    loop, recorder, _ = _run_loop(engine, 60.0, pace=True)
    loop.start()
    loop.submit(_submission("a", rng, 50))
    assert recorder.holding.wait(30)
    start = time.perf_counter()
    loop.stop(10)
    assert time.perf_counter() - start < 5.0
    assert not loop._thread.is_alive()


class _Pacer:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def launched(self, started_at, queued_at):
        assert queued_at >= started_at
        self.events.append(("launched",))

    def completed(self, key, queued_at, read_at, seen_at):
        assert seen_at >= read_at
        self.events.append(("completed", key))

    def hold(self, key, queued_at, now):
        self.events.append(("hold", key))
        return 0.0


def test_the_engine_reports_each_step_by_its_shape(engine, rng):
    assert engine.async_scheduling
    pacer = engine._pacer = _Pacer()
    prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(20, 40))]
    engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # launches the prefill
    assert engine.launch_hold() == 0.0
    while engine.has_unfinished():
        engine.step()
    prefill = step_key(len(prompt), 1, len(prompt))
    decode = step_key(1, 0, 0)
    assert pacer.events == [
        ("launched",),
        ("hold", prefill),  # the prefill in flight
        ("launched",),
        ("completed", prefill),
        ("launched",),
        ("completed", decode),
        ("completed", decode),  # the last decode, read with nothing more to launch
    ]


def test_serve_takes_launch_pacing_as_an_opt_in():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="verb"))
    parse = lambda *argv: serve_options_from(vars(parser.parse_args(["serve", "ART", *argv])))  # noqa: E731
    assert parse().launch_pacing is False
    assert parse("--launch-pacing").launch_pacing is True
