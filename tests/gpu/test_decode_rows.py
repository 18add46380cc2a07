"""Short chunks as decode rows on the GPU (engine/decode_rows.py): verification-shaped steps replay a
decode graph, a row per token, and give the mixed graphs' logits for the same steps, and an engine
verifying drafts that way gives the model's greedy choices.

The logits are compared on a bf16 artifact, within 2% of the largest logit (as test_mixed_graphs.py
compares its paths; a wrong context or position moves logits by tens of percent). On the fp8 one the
two paths' attention kernels (decode against prefill) round differently, and an fp8 activation one
step apart is 6% away: at d7d6d30 they differed by 3.4-3.6% of the largest logit."""

from __future__ import annotations

import pytest
import qruntime
import torch
from qruntime import SamplingParams, SpeculativeConfig
from qruntime.engine.step_chunk import StepChunk

from gpu.conftest import GPU_MODEL
from gpu.test_speculative import _check_greedy, _prompts

pytestmark = pytest.mark.gpu


def _recorded(graphs) -> list[int]:
    """Wraps a DecodeGraphs' run: the rows of each step it replays."""
    rows, run = [], graphs.run
    graphs.run = lambda chunks, *args: (rows.append(len(chunks)), run(chunks, *args))[1]
    return rows


def test_verification_steps_equal_the_mixed_graphs(make_ckpt, compiled, cuda, rng):
    artifact = compiled(make_ckpt("tiny", **GPU_MODEL), "bf16")
    engine = qruntime.load(artifact, device=cuda, num_kv_blocks=256, prefix_cache=False)
    runner = engine.runner
    assert runner.decode_graphs is not None and runner.mixed_graphs is not None, engine.description
    rows, default = _recorded(runner.decode_graphs), runner.decode_rows_reads
    block_size, count = runner.kv_cache.spec.block_size, 3
    tables = [tuple(range(1 + 40 * s, 1 + 40 * s + 600 // block_size + 1)) for s in range(count)]
    tokens = [[rng.randrange(200) for _ in range(600)] for _ in range(count)]
    done = [rng.randint(20, 400) for _ in range(count)]
    runner.execute([StepChunk(tuple(tokens[s][: done[s]]), 0, tables[s]) for s in range(count)])
    for _ in range(4):
        sizes = [rng.randint(1, 5) for _ in range(count)]
        chunks = [StepChunk(tuple(tokens[s][done[s] : done[s] + n]), done[s], tables[s]) for s, n in enumerate(sizes)]
        wide = [n > 1 for n in sizes]
        got = runner.execute(chunks, all_logits=wide).float()
        runner.decode_rows_reads = 0
        want = runner.execute(chunks, all_logits=wide).float()  # the mixed graph, on the same cache contents
        runner.decode_rows_reads = default
        scale = float(want.abs().max())
        assert got.shape == want.shape == (sum(n if w else 1 for n, w in zip(sizes, wide, strict=True)), want.shape[1])
        assert float((got - want).abs().max()) <= 0.02 * scale, f"decode-row logits differ, chunks {sizes}"
        assert torch.isfinite(got).all()
        done = [d + n for d, n in zip(done, sizes, strict=True)]
    torch.cuda.synchronize()
    assert len(rows) == 4 and all(r >= count for r in rows), rows
    engine.close()


def test_an_engine_verifies_drafts_on_decode_graphs(gpu_artifact, cuda, rng):
    prompts = _prompts(rng, 4)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = qruntime.load(gpu_artifact, device=cuda, num_kv_blocks=256).generate(prompts, params)
    # the target drafts: most accepted. No gate: it may stop drafting after a few probes (12
    # verifications at 37dfcac, 70% accepted, the fp8 draft and verification paths parting at near-ties)
    config = SpeculativeConfig("draft-model", draft_model=str(gpu_artifact), gate=False)
    engine = qruntime.load(gpu_artifact, device=cuda, num_kv_blocks=256, speculative=config)
    rows = _recorded(engine.runner.decode_graphs)
    outputs = engine.generate(prompts, params)
    stats = engine.speculative_stats
    assert stats.verifications > 0 and stats.acceptance_rate > 0.8, stats
    assert max(rows) > len(prompts), rows  # verification steps: k + 1 rows a request
    _check_greedy(engine, prompts, outputs, plain)
    engine.close()
