"""Self-speculative decoding by layer skipping (engine/speculative/layer_skip.py, self_draft.py):
the reduced plan computes what transformers computes with those decoder layers deleted (fused and
unfused graphs, dense and MoE), and an engine drafting with it gives plain greedy outputs."""

from __future__ import annotations

import pytest
import qruntime
import torch
from hf_reference import hf_model
from qruntime import SamplingParams, SpeculativeConfig
from qruntime.engine.speculative.layer_skip import layer_of, skip_layers
from qruntime.engine.step_chunk import StepChunk
from qruntime.ops.base import StepContext


def _engine(artifact, speculative=None, **kw):
    return qruntime.load(artifact, device="cpu", dtype=torch.float32, num_kv_blocks=64, speculative=speculative, **kw)


def _skipped_logits(engine, plan, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), V] of `plan` over a prompt, in blocks of a scratch request."""
    manager = engine.scheduler.block_manager
    table = manager.grow("scratch", len(ids))
    try:
        feeds, meta = engine.runner.prepare([StepChunk(tuple(ids), 0, table)], all_logits=True)
        return plan.run(StepContext(engine.runner.kv_cache, meta), feeds).float()
    finally:
        manager.free("scratch")


@pytest.mark.parametrize("passes", [(), ("passes=[]",)], ids=["fused", "unfused"])
@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_moe_ckpt"])
def test_the_reduced_plan_is_the_model_without_those_layers(request, fixture, passes, compiled, rng):
    ckpt = request.getfixturevalue(fixture)
    engine = _engine(compiled(ckpt, "bf16", *passes))
    layers = engine.runner.kv_cache.spec.num_layers
    skip = sorted(rng.sample(range(layers), rng.randrange(1, layers)))
    print("skip", skip)
    ids = [rng.randrange(engine.vocab_size) for _ in range(rng.randrange(5, 40))]
    got = _skipped_logits(engine, skip_layers(engine.runner.plan, skip), ids)
    reference = hf_model(ckpt, torch.float32)
    reference.model.layers = torch.nn.ModuleList(m for i, m in enumerate(reference.model.layers) if i not in skip)
    with torch.inference_mode():
        want = reference(torch.tensor([ids]), use_cache=False).logits[0].float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    full = engine.score(ids)
    assert (full - want).abs().max() > 1e-2  # the skipped layers mattered


def test_skip_layers_refuses_what_it_cannot_rewire(tiny_ckpt, compiled):
    plan = _engine(compiled(tiny_ckpt, "bf16")).runner.plan
    with pytest.raises(ValueError, match="layer 9"):
        skip_layers(plan, [9])
    assert layer_of("model.layers.12.self_attn.qkv_proj") == 12 and layer_of("layers.3.attn") == 3
    assert layer_of("model.norm") is None and layer_of("lm_head") is None


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_moe_ckpt"])
def test_layer_skip_drafts_give_plain_greedy(request, fixture, compiled, rng):
    art = compiled(request.getfixturevalue(fixture), "bf16")
    prompts = [[rng.randrange(500) for _ in range(rng.randrange(3, 40))] for _ in range(4)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = _engine(art).generate(prompts, params)
    layers = _engine(art).runner.kv_cache.spec.num_layers
    engine = _engine(art, SpeculativeConfig("layer-skip", skip_layers=(layers - 1,), adaptive=False))
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]
    stats = engine.speculative_stats
    assert stats.drafted > 0 and stats.verifications > 0
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_skipping_no_layer_drafts_everything_right(tiny_ckpt, compiled, rng):
    """A layer-skip draft that skips nothing is the model itself: every greedy draft is accepted,
    which shows the draft reads the target's KV and writes its own where verification expects."""
    art = compiled(tiny_ckpt, "bf16")
    prompts = [[rng.randrange(500) for _ in range(rng.randrange(3, 40))] for _ in range(3)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = _engine(art).generate(prompts, params)
    engine = _engine(art, SpeculativeConfig("layer-skip", skip_layers=(0,), adaptive=False))
    engine.speculator.proposer.skip = ()
    engine.speculator.proposer.attach(engine.runner)
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]
    assert engine.speculative_stats.acceptance_rate > 0.95, engine.speculative_stats


def test_an_artifact_without_draft_layers_cannot_layer_skip(tiny_ckpt, compiled):
    with pytest.raises(ValueError, match="--draft-layers"):
        _engine(compiled(tiny_ckpt, "bf16"), "layer-skip")


def test_layer_skip_drafts_for_every_decoding_request_in_shared_steps(tiny_ckpt, compiled, rng):
    """Five requests decoding together: each drafting step runs the reduced plan k times over all of
    them (one batched step per draft token), not k times a request; greedy outputs stay plain's."""
    art = compiled(tiny_ckpt, "bf16")
    prompts = [[rng.randrange(500) for _ in range(rng.randrange(3, 20))] for _ in range(5)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = _engine(art).generate(prompts, params)
    layers = _engine(art).runner.kv_cache.spec.num_layers
    engine = _engine(art, SpeculativeConfig("layer-skip", skip_layers=(layers - 1,), adaptive=False))
    proposer = engine.speculator.proposer
    batches: list[int] = []
    forward = proposer._forward
    proposer._forward = lambda chunks, *a: (batches.append(len(chunks)), forward(chunks, *a))[1]
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps, outputs = [], {}
    while engine.has_unfinished():
        before = len(batches)
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
        steps.append(batches[before:])
    assert max(len(step) for step in steps) <= 4, steps  # k = 4 draft tokens: one reduced step each
    assert max(batches) == 5, batches  # every decoding request in one step
    assert [tuple(t) for t in outputs.values()] == [tuple(o.token_ids) for o in plain]
    assert engine.speculative_stats.verifications > 0
    assert engine.scheduler.block_manager.num_used_blocks == 0
