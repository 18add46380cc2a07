"""Whole-step (mixed) graphs on CPU: the capture is injected (eager_capture runs the body where a CUDA
graph would replay it) and attention is the fast path's op, whose kernels Triton's interpreter runs,
launched from bounds (the captured form). So everything else is what a GPU runs: the bucket a step
takes, its token rows padded and its sequences laid into buffers of max_seqs rows over whatever the
last step left there, the grids sized from those buffers alone, and the eager logits tail. A mixed
step gives the eager plan's logits and KV cache; padding rows write the scratch block alone."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from qruntime.engine.graph_capture import eager_capture
from qruntime.engine.mixed_graphs import MixedGraphs, mixed_unfit_reason
from qruntime.engine.model_runner import ModelRunner
from qruntime.engine.piecewise_graphs import PiecewiseGraphs
from qruntime.engine.step_chunk import pending
from qruntime.ops import attention
from qruntime.ops.triton_ops import PagedAttention as FastPagedAttention
from qruntime.plan import Plan
from test_piecewise_graphs import BLOCKS, MAX_CONTEXT, Sequences, _block_diff, _caches, _plan, _scratch_blocks, _steps

MAX_SEQS = 6


def _fast_attention_plan(artifact, moe_kernel: bool = False):
    """_plan's reference plan with the fast path's attention op (the one that launches from bounds)."""
    plan, spec, vocab = _plan(artifact, moe_kernel)
    nodes = [
        dataclasses.replace(node, op=FastPagedAttention(node.op.a, node.op.env))
        if isinstance(node.op, attention.PagedAttention)
        else node
        for node in plan.nodes
    ]
    return Plan(tuple(nodes), plan.weights, plan.output), spec, vocab


class Counted:
    """Wraps a MixedGraphs' run, counting the steps it replays."""

    def __init__(self, graphs: MixedGraphs) -> None:
        self.steps, run = 0, graphs.run

        def counted(*args, **kwargs):
            self.steps += 1
            return run(*args, **kwargs)

        graphs.run = counted


def _runners(plan, spec, buckets, rng) -> tuple[ModelRunner, ModelRunner]:
    eager_cache, graph_cache = _caches(spec, rng)
    eager = ModelRunner(plan, eager_cache, torch.device("cpu"), MAX_CONTEXT)
    graphs = MixedGraphs(plan, graph_cache, buckets, BLOCKS, MAX_CONTEXT, MAX_SEQS, capture=eager_capture)
    return eager, ModelRunner(plan, graph_cache, torch.device("cpu"), MAX_CONTEXT, mixed_graphs=graphs)


def _check_same(eager: ModelRunner, mixed: ModelRunner, steps, atol: float) -> None:
    counted = Counted(mixed.mixed_graphs)
    for chunks in steps:
        tokens = sum(c.num_tokens for c in chunks)
        for block in _scratch_blocks(mixed.kv_cache):
            block.fill_(float("nan"))  # were a real row to read it, its logits would be NaN
        want, got = eager.execute(chunks), mixed.execute(chunks)
        assert got.shape == want.shape == (len(chunks), want.shape[1])
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m, tokens=tokens: f"{tokens} tokens: {m}")
        assert _block_diff(eager.kv_cache, mixed.kv_cache) <= {BLOCKS}
    assert counted.steps == len(steps)  # every step replayed its bucket's graph


@pytest.mark.parametrize("recipe", ["bf16", "ptpc-fp8"])
def test_dense_prefill_and_mixed_steps_equal_the_eager_plan(tiny_ckpt, compiled, recipe, rng):
    plan, spec, vocab = _fast_attention_plan(compiled(tiny_ckpt, recipe))
    buckets = sorted(rng.sample(range(8, 64), 2)) + [64]
    print("buckets", buckets)
    eager, mixed = _runners(plan, spec, buckets, rng)
    seqs = Sequences(rng, vocab, 4, spec.block_size)
    # fp8 activations: a tie in a quantization step may round either way if M changes a GEMM's blocking
    _check_same(eager, mixed, _steps(rng, seqs, 64), atol=1e-4 if recipe == "bf16" else 2e-3)


def test_moe_prefill_and_mixed_steps_equal_the_eager_plan(tiny_moe_ckpt, compiled, rng):
    plan, spec, vocab = _fast_attention_plan(compiled(tiny_moe_ckpt, "ptpc-fp8"), moe_kernel=True)
    assert mixed_unfit_reason(plan) is None
    eager, mixed = _runners(plan, spec, (16, 32), rng)
    seqs = Sequences(rng, vocab, 3, spec.block_size)
    _check_same(eager, mixed, _steps(rng, seqs, 32, mixed=2), atol=2e-3)


def test_static_inputs_hold_the_step_and_empty_sequences_after_it(tiny_ckpt, compiled, rng):
    """After a step of 4 sequences, one of 1 or 2: the buffers hold its sequences first, then empty
    ones (query_start_loc repeats its token count) over the rows the last step left; token rows are
    padded to the bucket with the padding values."""
    plan, spec, vocab = _fast_attention_plan(compiled(tiny_ckpt, "bf16"))
    eager, mixed = _runners(plan, spec, (8, 32), rng)
    graphs = mixed.mixed_graphs
    seqs = Sequences(rng, vocab, 4, spec.block_size)
    first = [seqs.chunk(s, rng.randint(2, 7)) for s in range(4)]
    torch.testing.assert_close(mixed.execute(first), eager.execute(first), atol=1e-4, rtol=0)
    second = [seqs.chunk(s, rng.randint(1, 3)) for s in range(rng.randint(1, 2))]
    tokens = sum(c.num_tokens for c in second)
    feeds, _ = mixed.prepare(second)
    torch.testing.assert_close(mixed.execute(second), eager.execute(second), atol=1e-4, rtol=0)
    bucket, inputs = graphs.bucket_for(tokens), graphs.inputs
    assert bucket == 8
    for name, pad in graphs.padding.items():
        assert torch.equal(inputs[name][:tokens], feeds[name]), name
        assert bool((inputs[name][tokens:bucket] == pad).all()), name
    n = len(second)
    assert torch.equal(inputs["query_start_loc"][: n + 1], feeds["query_start_loc"])
    assert inputs["query_start_loc"][n + 1 :].tolist() == [tokens] * (MAX_SEQS - n)
    assert torch.equal(inputs["context_lens"][:n], feeds["context_lens"])
    width = feeds["block_tables"].shape[1]
    assert torch.equal(inputs["block_tables"][:n, :width], feeds["block_tables"])
    assert graphs.bucket_for(33) is None


def test_the_runner_sends_each_step_where_it_fits(tiny_ckpt, compiled, rng, monkeypatch):
    """Other steps than decodes to the mixed graphs; those whose attention prefers an eager launch
    (fresh long prompts), or with more sequences than max_seqs, to the piecewise graphs; over the
    largest bucket, or all_logits, to the eager plan."""
    plan, spec, vocab = _fast_attention_plan(compiled(tiny_ckpt, "bf16"))
    eager, runner = _runners(plan, spec, (8, 16), rng)
    runner.piecewise_graphs = PiecewiseGraphs(plan, runner.kv_cache, (16,), BLOCKS, MAX_CONTEXT, capture=eager_capture)
    calls = []
    for name, graphs in (("mixed", runner.mixed_graphs), ("piecewise", runner.piecewise_graphs)):
        run = graphs.run
        graphs.run = lambda *args, name=name, run=run: (calls.append(name), run(*args))[1]
    eager_steps = []
    # only the one-prompt step of 13 tokens; the first step may also total 13 tokens (1 + 12)
    monkeypatch.setattr(FastPagedAttention, "prefers_eager", lambda op, meta: list(meta.query_start) == [0, 13])
    seqs = Sequences(rng, vocab, MAX_SEQS + 1, spec.block_size)
    steps = [
        [seqs.chunk(0, 1), seqs.chunk(1, rng.randint(2, 15))],  # mixed
        [seqs.chunk(2, 13)],  # "a fresh long prompt": piecewise
        [seqs.chunk(0, 9), seqs.chunk(1, 8)],  # 17 tokens: eager
        [seqs.chunk(s, 1) for s in range(MAX_SEQS + 1)],  # 7 sequences (no decode graphs here): piecewise
    ]
    for chunks in steps:
        torch.testing.assert_close(runner.execute(chunks), eager.execute(chunks), atol=1e-4, rtol=0)
    eager_steps.append(runner.execute([seqs.chunk(3, 3)], all_logits=True).shape[0])
    assert calls == ["mixed", "piecewise", "piecewise"] and eager_steps == [3]


def test_plans_whose_attention_needs_the_host_are_refused(tiny_ckpt, compiled):
    reference, spec, _ = _plan(compiled(tiny_ckpt, "bf16"))
    assert "runs only on the step's own sequences" in mixed_unfit_reason(reference)
    with pytest.raises(ValueError, match="own sequences"):
        MixedGraphs(reference, _caches(spec, random.Random(0))[0], (16,), BLOCKS, MAX_CONTEXT, 4, capture=eager_capture)
    per_tensor, _, _ = _fast_attention_plan(compiled(tiny_ckpt, "tensor-fp8"))
    assert "mixes rows" in mixed_unfit_reason(per_tensor)


def test_pending_ids_and_every_row_of_some_chunks(tiny_ckpt, compiled, rng):
    """A step whose chunks end on ids sampled by the step before, still on the device (async
    scheduling: pending ids), and that wants every row's logits of some chunks (a speculative
    verification): the eager plan's logits for the resolved ids, on the same rows."""
    plan, spec, vocab = _fast_attention_plan(compiled(tiny_ckpt, "bf16"))
    eager, mixed = _runners(plan, spec, (8, 32), rng)
    count = 4
    seqs = Sequences(rng, vocab, count, spec.block_size)
    first = [seqs.chunk(s, rng.randint(2, 6)) for s in range(count)]
    torch.testing.assert_close(mixed.execute(first), eager.execute(first), atol=1e-4, rtol=0)
    sampled = torch.tensor([rng.randrange(vocab) for _ in range(count + 2)])
    rows = rng.sample(range(count + 2), count)  # each chunk's last id is a row of `sampled`
    resolved = [seqs.chunk(s, rng.randint(1, 5)) for s in range(count)]
    chunks = [
        dataclasses.replace(c, token_ids=(*c.token_ids[:-1], pending(row)))
        for c, row in zip(resolved, rows, strict=True)
    ]
    resolved = [
        dataclasses.replace(c, token_ids=(*c.token_ids[:-1], int(sampled[row])))
        for c, row in zip(resolved, rows, strict=True)
    ]
    wide = [rng.random() < 0.5 for _ in range(count)]
    want, got = eager.execute(resolved, all_logits=wide), mixed.execute(chunks, all_logits=wide, sampled=sampled)
    assert got.shape == want.shape == (sum(c.num_tokens if w else 1 for c, w in zip(chunks, wide, strict=True)), vocab)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert _block_diff(eager.kv_cache, mixed.kv_cache) <= {BLOCKS}
