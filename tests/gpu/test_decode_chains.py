"""Chains of greedy decode steps on the GPU (engine/decode_chains.py): one CUDA graph replay gives the
tokens that replaying the decode graph once a step and taking each step's argmax gives, and the KV
it writes; draft-model and layer-skip engines drafting through chains (SpeculativeConfig.chain, off by
default) still give the model's greedy choices.

Stepped and chained rows run at the same bucket (every row runs every step), so both run the same
kernels on the same inputs: the tokens must be equal, not merely close."""

from __future__ import annotations

import pytest
import qruntime
import torch
from qruntime import SamplingParams, SpeculativeConfig
from qruntime.engine.decode_chains import DecodeChains
from qruntime.engine.step_chunk import StepChunk, pending

from gpu.conftest import GPU_MODEL
from gpu.test_speculative import _check_greedy, _prompts

pytestmark = pytest.mark.gpu


def test_a_chain_replays_what_stepping_the_decode_graph_gives(make_ckpt, compiled, cuda, rng):
    artifact = compiled(make_ckpt("tiny", **GPU_MODEL), "bf16")
    engine = qruntime.load(artifact, device=cuda, num_kv_blocks=512, prefix_cache=False)
    runner, graphs = engine.runner, engine.runner.decode_graphs
    assert graphs is not None, engine.description
    chains = DecodeChains(graphs)
    block_size, count, steps = runner.kv_cache.spec.block_size, 5, 4
    blocks = 600 // block_size + 1
    tables = [tuple(range(1 + blocks * s, 1 + blocks * (s + 1))) for s in range(count)]
    mirror = [tuple(range(1 + blocks * (s + count), 1 + blocks * (s + count + 1))) for s in range(count)]
    tokens = [[rng.randrange(200) for _ in range(600)] for _ in range(count)]
    done = [rng.randint(20, 500) for _ in range(count)]
    for table in (tables, mirror):  # the same prompts twice, on other blocks: one copy stepped, one chained
        runner.execute([StepChunk(tuple(tokens[s][: done[s]]), 0, table[s]) for s in range(count)])
    sampled = torch.tensor([rng.randrange(200) for _ in range(count)], device=cuda)
    first = [StepChunk((pending(s),), done[s], tables[s]) for s in range(count)]
    stepped, chunks = [], first
    for _ in range(steps):
        token = graphs.run(chunks, sampled if chunks is first else None).max(-1).indices  # as the chain picks
        stepped.append(token.tolist())
        chunks = [StepChunk((t,), c.start + 1, c.block_table) for c, t in zip(chunks, stepped[-1], strict=True)]
    ids, peaks = chains.run(
        [StepChunk((pending(s),), done[s], mirror[s]) for s in range(count)], [steps] * count, sampled
    )
    assert ids.tolist() == stepped
    assert torch.isfinite(peaks).all()
    cache = runner.kv_cache
    for s in range(count):  # every position of both copies, the prompt and the steps', in every layer
        slots = [
            [t[p // block_size] * block_size + p % block_size for p in range(done[s] + steps)]
            for t in (tables[s], mirror[s])
        ]
        for layer in range(cache.spec.num_layers):
            got, want = (cache.gather(layer, torch.tensor(x, device=cuda), 1.0, 1.0) for x in slots)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"sequence {s} layer {layer}"
    torch.cuda.synchronize()
    engine.close()


@pytest.mark.parametrize("method", ["draft-model", "layer-skip"])
def test_engines_draft_through_chains_and_decode_greedily(gpu_artifact, cuda, rng, method):
    prompts = _prompts(rng, 4)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = qruntime.load(gpu_artifact, device=cuda, num_kv_blocks=256).generate(prompts, params)
    config = {
        "draft-model": SpeculativeConfig("draft-model", draft_model=str(gpu_artifact), gate=False, chain=True),
        "layer-skip": SpeculativeConfig("layer-skip", skip_layers=(1,), gate=False, chain=True),
    }[method]
    engine = qruntime.load(gpu_artifact, device=cuda, num_kv_blocks=256, speculative=config)
    outputs = engine.generate(prompts, params)
    proposer = engine.speculator.proposer
    assert proposer.chains is not None and proposer.chains.chains, "no chain ran"
    stats = engine.speculative_stats
    assert stats.verifications > 0 and stats.drafted > 0, stats
    if method == "draft-model":  # the target drafts for itself: only bf16 near-ties reject
        assert stats.acceptance_rate > 0.8, stats
    _check_greedy(engine, prompts, outputs, plain)
    engine.close()
