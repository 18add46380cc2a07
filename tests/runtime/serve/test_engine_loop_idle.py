"""The engine loop's idle work (Engine.idle_work: the graphs a load with graph_capture="first-use"
left, then its warm-up steps): done one piece a turn while no request is unfinished, never while
one is, a request arriving meanwhile served before the rest, and no call once the engine says none
is left. The serve flag --graph-capture reaches the load."""

from __future__ import annotations

import argparse
import random
import threading
import time

import pytest
import qruntime
from qruntime import SamplingParams
from qruntime.serve.engine_loop import EngineLoop, Submission
from qruntime.serve.options import add_serve_parser, serve_options_from
from qruntime.serve.protocol import SequenceSpec


@pytest.fixture(scope="module")
def artifact(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "bf16")


class _IdleWork:
    """Stands in for Engine.idle_work (a CPU engine captures no graphs): `pieces` pieces of
    `seconds` each, recording whether the engine had an unfinished request at each call."""

    def __init__(self, engine, pieces: int, seconds: float) -> None:
        self.engine, self.left, self.seconds = engine, pieces, seconds
        self.calls: list[bool] = []
        self.finished = threading.Event()
        self.first = threading.Event()
        engine.idle_work = self

    def __call__(self) -> bool:
        self.calls.append(self.engine.has_unfinished())
        self.first.set()
        if self.left:
            time.sleep(self.seconds)
            self.left -= 1
        if not self.left:
            self.finished.set()
        return self.left > 0


def _submission(name: str, rng: random.Random) -> Submission:
    prompt = tuple(rng.randrange(1, 500) for _ in range(rng.randrange(3, 30)))
    spec = SequenceSpec(0, 0, prompt, SamplingParams(max_tokens=rng.randrange(2, 8), ignore_eos=True))
    return Submission(name, (spec,), time.perf_counter())


def test_idle_work_runs_while_nothing_does_and_a_request_goes_first(artifact, rng):
    engine = qruntime.load(artifact, device="cpu", num_kv_blocks=64)
    pieces = rng.randrange(20, 40)
    idle = _IdleWork(engine, pieces, 0.02)
    done = threading.Event()
    served_at: list[int] = []

    def sink(items, ended):
        if ended:
            served_at.append(pieces - idle.left)  # pieces done when the request ended
            done.set()

    loop = EngineLoop(engine, sink)
    loop.start()
    try:
        assert idle.first.wait(30)  # the loop starts on its idle work with no request
        loop.submit(_submission("a", rng))
        assert done.wait(60)
        done.clear()
        assert idle.finished.wait(60)
        time.sleep(0.2)  # the loop waits now: no call after the engine said none is left
        loop.submit(_submission("b", rng))  # a request after the idle work is served as ever
        assert done.wait(60)
        time.sleep(0.1)
    finally:
        loop.stop(10)
    assert not any(idle.calls), "idle work was done while a request was unfinished"
    assert len(idle.calls) == pieces  # each call a piece; none once the last one said none is left
    assert served_at[0] < pieces, "the request waited for the whole idle work"
    assert len(served_at) >= 2


def test_the_graph_capture_flag(artifact):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="verb"))
    parse = lambda *argv: serve_options_from(vars(parser.parse_args(["serve", "ART", *argv])))  # noqa: E731
    assert parse().graph_capture == "first-use"
    assert parse("--graph-capture", "load").graph_capture == "load"
    with pytest.raises(SystemExit):
        parse("--graph-capture", "later")
    with pytest.raises(ValueError, match="graph_capture must be one of first-use, load, got 'later'"):
        qruntime.load(artifact, device="cpu", num_kv_blocks=64, graph_capture="later")
