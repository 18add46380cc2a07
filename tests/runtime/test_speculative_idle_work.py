"""A speculating engine's start-up work left for later (Engine.idle_work, Proposer.idle_work): a draft
model's engine, loaded with the target's graph_capture, captures its graphs and runs its warm-up
steps when the target's idle work is done and no request is unfinished; a layer-skip draft captures
its decode graphs, largest first. On CPU no load leaves graphs uncaptured, so the tests give the
runners work that stands in (a warm-up step, graphs captured eagerly) and check who does it when,
and that the outputs stay plain greedy decoding's."""

from __future__ import annotations

import random

import pytest
import qruntime
import torch
from qruntime import SamplingParams, SpeculativeConfig
from qruntime.engine.cuda_graphs import DecodeGraphs
from qruntime.engine.graph_capture import eager_capture

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "bf16")


def _engine(artifact, speculative=None, **kw):
    return qruntime.load(artifact, device="cpu", dtype=torch.float32, num_kv_blocks=64, speculative=speculative, **kw)


def _prompts(rng: random.Random, count: int) -> list[list[int]]:
    return [[rng.randrange(500) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


def test_the_draft_models_start_up_work_waits_for_the_targets_and_for_idle_time(target, rng):
    prompts = _prompts(rng, 3)
    plain = [o.token_ids for o in _engine(target).generate(prompts, GREEDY)]
    with _engine(target, SpeculativeConfig("draft-model", draft_model=str(target), num_tokens=3)) as engine:
        draft = engine.speculator.proposer.engine
        assert draft.description.get("graph_capture") is None  # CPU: no graphs, nothing left
        assert not engine.idle_work()
        done = []
        draft.runner.warm_up = lambda: done.append(("draft", engine.has_unfinished()))
        engine.runner.warm_up = lambda: done.append(("target", engine.has_unfinished()))
        engine.add_request(prompts[0], GREEDY)
        assert engine.idle_work() and done == []  # a request is unfinished: the work waits
        while engine.has_unfinished():
            engine.step()
        assert engine.idle_work() and done == [("target", False)]  # the target's own first
        assert not engine.idle_work() and done == [("target", False), ("draft", False)]
        assert not engine.idle_work() and len(done) == 2
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == plain


def test_a_layer_skip_draft_captures_its_decode_graphs_largest_first_when_idle(target, rng):
    prompts = _prompts(rng, 3)
    plain = [o.token_ids for o in _engine(target).generate(prompts, GREEDY)]
    layers = _engine(target).runner.kv_cache.spec.num_layers
    config = SpeculativeConfig("layer-skip", skip_layers=(layers - 1,), num_tokens=3, adaptive=False)
    with _engine(target, config, prefix_cache=False) as engine:  # no cached block outlives its request
        runner, proposer = engine.runner, engine.speculator.proposer
        assert not proposer.has_idle_work() and not engine.idle_work()  # CPU: no graphs to capture
        # decode graphs on the target's runner (captured eagerly: CPU), so the draft makes its own, lazily
        buckets = (1, 2, 4)
        # the padding rows write a block, free while the engine is idle (idle work runs then only)
        scratch = engine.scheduler.block_manager.num_blocks - 1
        runner.decode_graphs = DecodeGraphs(
            runner.plan, runner.kv_cache, scratch, runner.max_context_len, buckets, capture=eager_capture, lazy=True
        )
        proposer.attach(runner)
        runner.decode_graphs = None  # the target's steps as before; the draft keeps its graphs
        assert proposer.graphs.pending == buckets and proposer.graphs.capturer is eager_capture  # the target's
        engine.add_request(prompts[0], GREEDY)
        assert engine.idle_work() and proposer.graphs.pending == buckets  # a request is unfinished
        while engine.has_unfinished():
            engine.step()
        left = [proposer.graphs.pending]
        for _ in range(len(buckets)):  # bounded: idle work that does nothing would loop for ever
            if not engine.idle_work():
                break
            left.append(proposer.graphs.pending)
        left.append(proposer.graphs.pending)
        # the request's drafts captured bucket 1 at first use; idle work the rest, one a call, largest first
        assert left == [(2, 4), (2,), ()]
        assert not engine.idle_work()
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == plain
