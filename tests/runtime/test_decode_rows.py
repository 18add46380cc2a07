"""Short chunks run as decode rows (engine/decode_rows.py): the split itself, and a runner whose decode
graphs (captured with eager_capture on CPU; attention is the fast path's op, which Triton's interpreter
runs) take verification-shaped steps: the eager plan's logits on the same rows, and its KV cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from qruntime.engine.cuda_graphs import DecodeGraphs
from qruntime.engine.decode_rows import MAX_ROWS, MAX_ROWS_PER_CHUNK, decode_rows
from qruntime.engine.graph_capture import eager_capture
from qruntime.engine.model_runner import ModelRunner
from qruntime.engine.step_chunk import StepChunk, pending
from qruntime.kv_cache import KVCacheSpec
from test_mixed_graphs import _fast_attention_plan
from test_piecewise_graphs import BLOCKS, MAX_CONTEXT, Sequences, _block_diff, _caches, _scratch_blocks

BUCKETS = (1, 2, 4, 8, 16, 32)


def test_each_token_becomes_a_row_at_its_position_on_the_chunks_table():
    verify = StepChunk((7, 8, 9), 40, (3, 5, 6))
    decode = StepChunk((4,), 12, (1,))
    catch_up = StepChunk((5, 6), 20, (2, 9))
    rows = decode_rows([verify, decode, catch_up], [True, False, False], max_reads=3 * 43 + 2 * 22)
    assert [(r.token_ids, r.start, r.block_table) for r in rows.chunks] == [
        ((7,), 40, (3, 5, 6)),
        ((8,), 41, (3, 5, 6)),
        ((9,), 42, (3, 5, 6)),
        ((4,), 12, (1,)),
        ((5,), 20, (2, 9)),
        ((6,), 21, (2, 9)),
    ]
    assert rows.keep == (0, 1, 2, 3, 5)  # every row of the verification, the last of the others
    assert decode_rows([verify, decode], [True, True], 1000).keep is None
    assert decode_rows([catch_up], False, 1000).keep == (1,)


def test_m_rope_positions_split_by_row():
    axes = ((10, 11), (20, 21), (30, 31))
    rows = decode_rows([StepChunk((1, 2), 10, (0,), axes)], [True], 1000)
    assert [r.mrope for r in rows.chunks] == [((10,), (20,), (30,)), ((11,), (21,), (31,))]


def test_steps_whose_rows_read_too_much_are_not_split():
    """A chunk of n tokens ending at position e reads n * e context positions as rows; decode rows
    (one token) count nothing: a plain decode step reads as much either way."""
    verify, other = StepChunk((1, 2, 3), 40, (0, 1, 2)), StepChunk((4, 5), 20, (3, 4))
    reads = 3 * 43 + 2 * 22
    assert decode_rows([verify, other], False, reads) is not None
    assert decode_rows([verify, other], False, reads - 1) is None
    assert decode_rows([StepChunk((1,), 999, (0,) * 63), verify], False, 3 * 43) is not None
    long = StepChunk(tuple(range(MAX_ROWS_PER_CHUNK + 1)), 0, (0, 1))
    assert decode_rows([long], False, 10**9) is None
    many = [StepChunk((1, 2), 2 * i, (i,)) for i in range(MAX_ROWS // 2)]
    assert len(decode_rows(many, False, 10**9).chunks) == MAX_ROWS
    assert decode_rows([*many, StepChunk((1,), 0, (0,))], False, 10**9) is None
    assert decode_rows(many, False, 10**9, max_rows=MAX_ROWS - 1) is None
    assert decode_rows([StepChunk((1, 2), 0, (0,), vision_rows=(0,))], False, 10**9) is None
    assert decode_rows([StepChunk((1, 2), 0, (0,))], True, 10**9) is None  # a scoring pass
    with pytest.raises(ValueError, match="2 entries for 1 chunks"):
        decode_rows([StepChunk((1, 2), 0, (0,))], [True, False], 10**9)


class _Counted:
    def __init__(self, graphs: DecodeGraphs) -> None:
        self.rows, run = [], graphs.run

        def counted(chunks, sampled=None):
            self.rows.append(len(chunks))
            return run(chunks, sampled)

        graphs.run = counted


def graph_runners(artifact, rng, lazy: bool = False) -> tuple[KVCacheSpec, int, ModelRunner, ModelRunner]:
    """The artifact's plan with the fast path's attention, run by an eager runner and by a runner on
    eager-captured decode graphs (BUCKETS), each on its copy of the same random KV cache: (KV spec,
    vocabulary size, eager runner, graph runner)."""
    plan, spec, vocab = _fast_attention_plan(artifact)
    eager_cache, graph_cache = _caches(spec, rng)
    cpu = torch.device("cpu")
    graphs = DecodeGraphs(
        plan, graph_cache, BLOCKS, MAX_CONTEXT, BUCKETS, max_sampled=8, capture=eager_capture, lazy=lazy
    )
    return (
        spec,
        vocab,
        ModelRunner(plan, eager_cache, cpu, MAX_CONTEXT),
        ModelRunner(plan, graph_cache, cpu, MAX_CONTEXT, graphs),
    )


def test_verification_steps_on_decode_graphs_equal_the_eager_plan(tiny_ckpt, compiled, rng):
    spec, vocab, eager, runner = graph_runners(compiled(tiny_ckpt, "bf16"), rng)
    eager_cache, graph_cache, graphs = eager.kv_cache, runner.kv_cache, runner.decode_graphs
    count = 4
    seqs = Sequences(rng, vocab, count, spec.block_size)
    prompts = [seqs.chunk(s, rng.randint(3, 9)) for s in range(count)]
    torch.testing.assert_close(runner.execute(prompts), eager.execute(prompts), atol=1e-4, rtol=0)  # eager: a prefill
    counted, steps = _Counted(graphs), []
    for step in range(4):
        for block in _scratch_blocks(graph_cache):
            block.fill_(float("nan"))  # were a real row to read it, its logits would be NaN
        sizes = [rng.randint(1, 5) for _ in range(count)]  # each request's last token and up to 4 drafts
        steps.append(sum(sizes))
        resolved = [seqs.chunk(s, n) for s, n in enumerate(sizes)]
        wide = [n > 1 and rng.random() < 0.8 for n in sizes]  # some multi-token chunks want only their last row
        sampled, chunks = None, resolved
        if step % 2:  # async scheduling: each chunk's first id is still on the device, a row of `sampled`
            sampled = torch.tensor([rng.randrange(vocab) for _ in range(count + 2)])
            at = rng.sample(range(count + 2), count)
            chunks = [
                dataclasses.replace(c, token_ids=(pending(r), *c.token_ids[1:]))
                for c, r in zip(resolved, at, strict=True)
            ]
            resolved = [
                dataclasses.replace(c, token_ids=(int(sampled[r]), *c.token_ids[1:]))
                for c, r in zip(resolved, at, strict=True)
            ]
        want = eager.execute(resolved, all_logits=wide)
        got = runner.execute(chunks, all_logits=wide, sampled=sampled)
        assert got.shape == want.shape == (sum(n if w else 1 for n, w in zip(sizes, wide, strict=True)), vocab)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m, sizes=sizes: f"chunks {sizes}: {m}")
        assert _block_diff(eager_cache, graph_cache) <= {BLOCKS}
    assert counted.rows == steps  # each step replayed a decode graph, a row per token
    runner.decode_rows_reads = 0  # no chunk of several tokens is split now: an eager step
    chunks = [seqs.chunk(0, 2)]
    torch.testing.assert_close(runner.execute(chunks, [True]), eager.execute(chunks, [True]), atol=1e-4, rtol=0)
    assert len(counted.rows) == 4
