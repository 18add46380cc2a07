"""Chains of greedy decode steps (engine/decode_chains.py) on CPU: the capture is injected (eager_capture
runs the body where a CUDA graph would replay it; attention is the fast path's op, which Triton's
interpreter runs), so what a GPU replays runs here: each step's argmax fed to the next on the device,
the later steps' positions, KV slots and context lengths staged by the host from the block tables,
rows that ran their steps parked on the scratch block. A chain gives the tokens, the peak logits and the KV cache that greedy
steps of the eager plan give, one step at a time over the rows still running."""

from __future__ import annotations

import pytest
import torch
from qruntime import SpeculativeConfig
from qruntime.engine.cuda_graphs import DecodeGraphs
from qruntime.engine.decode_chains import DecodeChains
from qruntime.engine.graph_capture import eager_capture
from qruntime.engine.model_runner import ModelRunner
from qruntime.engine.step_chunk import StepChunk, pending
from test_decode_rows import BUCKETS, graph_runners
from test_piecewise_graphs import BLOCKS, MAX_CONTEXT, Sequences, _block_diff, _scratch_blocks


def _stepped(eager: ModelRunner, chunks: list[StepChunk], remaining: list[int]) -> tuple[list[list[int]], list]:
    """Greedy steps of the eager plan: row b runs remaining[b] steps from its chunk (real ids), each
    step over the rows still running. Each row's tokens, and each row's peak logits."""
    tokens: list[list[int]] = [[] for _ in chunks]
    peaks: list[list[float]] = [[] for _ in chunks]
    current = list(chunks)
    for step in range(max(remaining)):
        rows = [b for b, left in enumerate(remaining) if left > step]
        peak, token = eager.execute([current[b] for b in rows]).max(-1)
        for row, b in enumerate(rows):
            tokens[b].append(int(token[row]))
            peaks[b].append(float(peak[row]))
            current[b] = StepChunk((int(token[row]),), current[b].start + 1, current[b].block_table)
    return tokens, peaks


def test_a_chain_decodes_what_greedy_steps_of_the_plan_decode(tiny_ckpt, compiled, rng):
    spec, vocab, eager, runner = graph_runners(compiled(tiny_ckpt, "bf16"), rng)
    eager_cache, graph_cache = eager.kv_cache, runner.kv_cache
    chains = DecodeChains(runner.decode_graphs)
    count = 4
    seqs = Sequences(rng, vocab, count, spec.block_size)
    prompts = [seqs.chunk(s, rng.randint(3, 12)) for s in range(count)]
    torch.testing.assert_close(runner.execute(prompts), eager.execute(prompts), atol=1e-4, rtol=0)
    for run in range(2):
        for block in _scratch_blocks(graph_cache):
            block.fill_(float("nan"))  # were a running row to read it, its tokens would differ
        rows = rng.sample(range(count), rng.randint(1, count))  # fresh buckets and row orders
        remaining = [rng.randint(1, 4) for _ in rows]
        remaining[rng.randrange(len(rows))] = 4 if run == 0 else remaining[0]
        chunks = [seqs.chunk(s, 1) for s in rows]
        # the first step's ids are still on the device (the draft's first step drew them): pending rows
        sampled = torch.tensor([rng.randrange(vocab) for _ in range(len(rows) + 2)])
        at = rng.sample(range(len(rows) + 2), len(rows))
        resolved = [StepChunk((int(sampled[r]),), c.start, c.block_table) for c, r in zip(chunks, at, strict=True)]
        pending_chunks = [StepChunk((pending(r),), c.start, c.block_table) for c, r in zip(chunks, at, strict=True)]
        want_tokens, want_peaks = _stepped(eager, resolved, remaining)
        ids, peaks = chains.run(pending_chunks, remaining, sampled)
        assert ids.shape == peaks.shape == (max(remaining), len(rows))
        for b, left in enumerate(remaining):
            assert ids[:left, b].tolist() == want_tokens[b], f"run {run} row {b} of {remaining}"
            torch.testing.assert_close(peaks[:left, b], torch.tensor(want_peaks[b]), atol=1e-4, rtol=0)
        assert _block_diff(eager_cache, graph_cache) <= {BLOCKS}, f"run {run}: {remaining}"
        for s, left in zip(rows, remaining, strict=True):  # the next chunk goes after the KV the chain wrote
            seqs.done[s] += left - 1
    assert {steps for _, steps in chains.chains} >= {4}
    decode = [seqs.chunk(s, 1) for s in range(count)]  # the decode graphs still run plain steps after chains
    torch.testing.assert_close(runner.execute(decode), eager.execute(decode), atol=1e-4, rtol=0)


def test_rows_that_ran_their_steps_stay_inside_their_tables(tiny_ckpt, compiled, rng):
    """A row at the last position of the longest context, with one step to run, beside a row of 4: the
    three steps it sits out write the scratch block and index nothing past its table."""
    spec, vocab, eager, runner = graph_runners(compiled(tiny_ckpt, "bf16"), rng, lazy=True)
    eager_cache, graph_cache, graphs = eager.kv_cache, runner.kv_cache, runner.decode_graphs
    chains = DecodeChains(graphs)
    size = spec.block_size
    blocks = rng.sample(range(BLOCKS), graphs.max_blocks + 1)
    full = StepChunk((rng.randrange(vocab),), MAX_CONTEXT - 1, tuple(blocks[:-1]))
    other = StepChunk((rng.randrange(vocab),), rng.randrange(size - 4), (blocks[-1],))
    want, _ = _stepped(eager, [full, other], [1, 4])
    ids, _ = chains.run([full, other], [1, 4])
    assert ids[:1, 0].tolist() == want[0] and ids[:, 1].tolist() == want[1]
    # the steps it sits out stay at its position: a context past the longest would read past its table
    assert chains.wide[0, :3, 0].tolist() == [MAX_CONTEXT - 1] * 3 and chains.lens[:3, 0].tolist() == [MAX_CONTEXT] * 3
    assert _block_diff(eager_cache, graph_cache) <= {BLOCKS}


def test_chains_refuse_rows_without_a_step_too_many_steps_and_m_rope_graphs(tiny_ckpt, compiled, rng):
    _, _, _, runner = graph_runners(compiled(tiny_ckpt, "bf16"), rng, lazy=True)
    plan, cache, graphs = runner.plan, runner.kv_cache, runner.decode_graphs
    chains = DecodeChains(graphs)
    chunk = StepChunk((1,), 0, (0,))
    with pytest.raises(ValueError, match="runs 1..16 steps"):
        chains.run([chunk, chunk], [2, 0])
    with pytest.raises(ValueError, match="runs 1..16 steps"):
        chains.run([chunk], [1, 1])
    with pytest.raises(ValueError, match="runs 1..16 steps"):
        chains.run([chunk], [17])
    assert not chains.fits([]) and chains.fits([chunk]) and not chains.fits([chunk] * (BUCKETS[-1] + 1))
    assert chains.run_fitting([chunk] * (BUCKETS[-1] + 1), [1] * (BUCKETS[-1] + 1)) is None  # no bucket holds it
    assert not chains.fits([StepChunk((1, 2), 0, (0,))])
    vl = DecodeGraphs(plan, cache, BLOCKS, MAX_CONTEXT, BUCKETS, mrope=True, capture=eager_capture, lazy=True)
    with pytest.raises(ValueError, match="M-RoPE"):
        DecodeChains(vl)


def test_chains_are_a_speculative_option_off_by_default():
    assert SpeculativeConfig().chain is False
    assert SpeculativeConfig.parse("layer-skip:chain=true").chain is True
    assert SpeculativeConfig.parse("draft-model:draft_model=/x,chain=1,num_tokens=6").chain is True
