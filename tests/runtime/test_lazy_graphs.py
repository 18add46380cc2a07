"""Graphs captured at first use (load's graph_capture="first-use"), on CPU: the capture is injected
(eager_capture runs the body where a CUDA graph would replay it) and attention is the fast path's op,
which Triton's interpreter runs. Nothing is captured when the graphs are made; a step whose bucket
has no graph yet captures it and then runs, giving the eager plan's logits and KV cache. A capture at
first use comes after other steps, whose rows the static buffers still hold: here a freed block is
given to another sequence before the capture, so a capture that ran on those stale rows would write
the first sequence's KV over the second's, and the caches would differ. idle_work captures the rest,
largest bucket first, then runs the warm-up steps once."""

from __future__ import annotations

import random

import torch
from qruntime.engine.cuda_graphs import DecodeGraphs
from qruntime.engine.graph_capture import eager_capture
from qruntime.engine.mixed_graphs import MixedGraphs
from qruntime.engine.model_runner import ModelRunner
from qruntime.engine.piecewise_graphs import PiecewiseGraphs
from qruntime.engine.step_chunk import StepChunk
from qruntime.ops.triton_ops import PagedAttention as FastPagedAttention
from test_mixed_graphs import _fast_attention_plan
from test_piecewise_graphs import BLOCKS, MAX_CONTEXT, _block_diff, _caches

MAX_SEQS = 4
DECODE, MIXED, PIECEWISE = (1, 2, 4), (8, 16, 32), (16, 32)


def _lazy_runner(plan, cache) -> ModelRunner:
    decode = DecodeGraphs(plan, cache, BLOCKS, MAX_CONTEXT, DECODE, capture=eager_capture, lazy=True)
    mixed = MixedGraphs(plan, cache, MIXED, BLOCKS, MAX_CONTEXT, MAX_SEQS, capture=eager_capture, lazy=True)
    piecewise = PiecewiseGraphs(plan, cache, PIECEWISE, BLOCKS, MAX_CONTEXT, capture=eager_capture, lazy=True)
    cpu = torch.device("cpu")
    return ModelRunner(plan, cache, cpu, MAX_CONTEXT, decode, piecewise, mixed_graphs=mixed)


class _Steps:
    """Chunks of random tokens on block tables the test picks (blocks given again once freed)."""

    def __init__(self, rng: random.Random, vocab: int) -> None:
        self.rng, self.vocab = rng, vocab

    def chunk(self, start: int, n: int, table: tuple[int, ...]) -> StepChunk:
        return StepChunk(tuple(self.rng.randrange(self.vocab) for _ in range(n)), start, table)


def test_graphs_captured_at_first_use_equal_the_eager_plan_over_reused_blocks(tiny_ckpt, compiled, rng, monkeypatch):
    plan, spec, vocab = _fast_attention_plan(compiled(tiny_ckpt, "bf16"))
    eager_cache, lazy_cache = _caches(spec, rng)
    eager = ModelRunner(plan, eager_cache, torch.device("cpu"), MAX_CONTEXT)
    lazy = _lazy_runner(plan, lazy_cache)
    decode, mixed, piecewise = lazy.decode_graphs, lazy.mixed_graphs, lazy.piecewise_graphs
    assert (decode.pending, mixed.pending, piecewise.pending) == (DECODE, MIXED, PIECEWISE)  # nothing yet
    bs = spec.block_size
    blocks = rng.sample(range(BLOCKS), 8)
    a, b, c, d, e, f, g, h = blocks
    make = _Steps(rng, vocab)
    prefers_eager = []  # the steps marked here go to the piecewise graphs
    monkeypatch.setattr(FastPagedAttention, "prefers_eager", lambda op, meta: bool(prefers_eager))
    late = rng.randrange(2, bs - 8)  # a decode position inside a block
    steps = [
        # sequence A's prompt in block a (mixed bucket 8, captured now)
        ("mixed", [make.chunk(0, 6, (a,))], False),
        # B, a fresh prompt, takes block a once A is freed (all logits: the eager plan) and overwrites A's rows
        ("eager", [make.chunk(0, 7, (a,))], True),
        # C's 20 tokens: mixed bucket 32 captured now, after A's step filled the buffers
        ("mixed", [make.chunk(0, 20, (b, c))], False),
        # D decodes at `late` in block d (decode bucket 1)
        ("decode", [make.chunk(late, 1, (d,))], False),
        # E takes block d and writes its prompt over D's row
        ("eager", [make.chunk(0, late + 3, (d,))], True),
        # two decodes: bucket 2 captured now, after D's step filled the buffers
        ("decode", [make.chunk(late, 1, (e,)), make.chunk(late + 1, 1, (f,))], False),
        # a prompt the attention op runs eagerly: piecewise bucket 16 at first use
        ("piecewise", [make.chunk(0, 12, (g,))], False),
        # and a mixed step of the captured bucket 8 beside it
        ("mixed", [make.chunk(late, 1, (e,)), make.chunk(0, 5, (h,))], False),
    ]
    for kind, chunks, all_logits in steps:
        prefers_eager[:] = [True] if kind == "piecewise" else []
        want = eager.execute(chunks, all_logits=all_logits)
        got = lazy.execute(chunks, all_logits=all_logits)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m, kind=kind: f"{kind} step: {m}")
        assert _block_diff(eager.kv_cache, lazy.kv_cache) <= {BLOCKS}, f"after a {kind} step"
    assert decode.pending == (4,) and mixed.pending == (16,) and piecewise.pending == (32,)


def test_idle_work_captures_the_rest_largest_first_then_warms_up_once(tiny_ckpt, compiled, rng):
    plan, spec, vocab = _fast_attention_plan(compiled(tiny_ckpt, "bf16"))
    eager_cache, lazy_cache = _caches(spec, rng)
    lazy = _lazy_runner(plan, lazy_cache)
    order = []
    for kind, graphs in (
        ("decode", lazy.decode_graphs),
        ("mixed", lazy.mixed_graphs),
        ("piecewise", lazy.piecewise_graphs),
    ):
        capture = graphs.capture
        graphs.capture = lambda bucket, kind=kind, capture=capture: (order.append((kind, bucket)), capture(bucket))[1]
    warmed = []
    lazy.warm_up = lambda: warmed.append(len(order))
    assert lazy.has_idle_work()
    rounds = 0
    while lazy.idle_work():
        rounds += 1
    total = len(DECODE) + len(MIXED) + len(PIECEWISE)
    assert rounds == total  # one piece a call: the last call (the warm-up) leaves none
    want = [("decode", b) for b in reversed(DECODE)] + [("mixed", b) for b in reversed(MIXED)]
    assert order == want + [("piecewise", b) for b in reversed(PIECEWISE)]
    assert warmed == [total]  # once, after every capture
    assert not lazy.has_idle_work() and not lazy.idle_work()
    # the graphs captured while idle serve steps as the eager plan does
    eager = ModelRunner(plan, eager_cache, torch.device("cpu"), MAX_CONTEXT)
    make = _Steps(rng, vocab)
    tables = [(blk,) for blk in rng.sample(range(BLOCKS), 3)]
    for chunks in (
        [make.chunk(0, 9, tables[0]), make.chunk(0, 3, tables[1])],
        [make.chunk(9, 1, tables[0]), make.chunk(3, 1, tables[1]), make.chunk(0, 1, tables[2])],
    ):
        torch.testing.assert_close(lazy.execute(chunks), eager.execute(chunks), atol=1e-4, rtol=0)
        assert _block_diff(eager.kv_cache, lazy.kv_cache) <= {BLOCKS}
    assert order == want + [("piecewise", b) for b in reversed(PIECEWISE)]  # no capture again


def test_graphs_made_to_capture_at_once_have_nothing_pending(tiny_ckpt, compiled, rng):
    plan, spec, _ = _fast_attention_plan(compiled(tiny_ckpt, "bf16"))
    cache = _caches(spec, rng)[0]
    made = [
        DecodeGraphs(plan, cache, BLOCKS, MAX_CONTEXT, DECODE, capture=eager_capture),
        MixedGraphs(plan, cache, MIXED, BLOCKS, MAX_CONTEXT, MAX_SEQS, capture=eager_capture),
        PiecewiseGraphs(plan, cache, PIECEWISE, BLOCKS, MAX_CONTEXT, capture=eager_capture),
    ]
    assert [g.pending for g in made] == [(), (), ()]
    runner = ModelRunner(plan, cache, torch.device("cpu"), MAX_CONTEXT, made[0], made[2], mixed_graphs=made[1])
    assert not runner.has_idle_work() and not runner.idle_work()
