"""The draft-model method (engine/speculative/draft_model.py) on the fp32 reference path: a draft
artifact sharing the target's vocabulary drafts with its own KV cache. With the target itself as its
draft, greedy drafts are all accepted and sampled drafts too (q = p: accepted with probability
min(1, p / q) = 1), which a point-mass verification would not do; with another model as the draft,
greedy outputs are plain decoding's."""

from __future__ import annotations

import random

import pytest
import qruntime
import torch
from qruntime import SamplingParams, SpeculativeConfig


@pytest.fixture(scope="module")
def target(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "bf16")


@pytest.fixture(scope="module")
def small_draft(make_ckpt, compiled):
    """tiny with one layer and other random weights: the same vocabulary and tokenizer."""
    return compiled(make_ckpt("tiny", seed=7, num_hidden_layers=1), "bf16")


def _engine(artifact, draft=None, **kw):
    speculative = SpeculativeConfig("draft-model", draft_model=str(draft), num_tokens=4) if draft else None
    return qruntime.load(artifact, device="cpu", dtype=torch.float32, num_kv_blocks=128, speculative=speculative, **kw)


def _prompts(rng: random.Random, count: int) -> list[list[int]]:
    return [[rng.randrange(500) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


def test_the_target_as_its_own_draft_is_accepted_greedy_and_sampled(target, rng):
    prompts = _prompts(rng, 4)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = _engine(target).generate(prompts, greedy)
    engine = _engine(target, target)
    assert [o.token_ids for o in engine.generate(prompts, greedy)] == [o.token_ids for o in plain]
    stats = engine.speculative_stats
    assert stats.acceptance_rate > 0.95, stats  # rejections only at fp32 near-ties of decode vs verify order
    seed = rng.randrange(1 << 30)
    sampled = [SamplingParams(max_tokens=24, temperature=1.0, seed=seed + i, ignore_eos=True) for i in range(4)]
    engine = _engine(target, target)
    out = engine.generate(prompts, sampled)
    assert all(len(o.token_ids) == 24 for o in out)
    # q = p: every draft is accepted (a point-mass verification would accept each with p(d) only, ~1/3 here)
    assert engine.speculative_stats.acceptance_rate > 0.95, engine.speculative_stats
    draft = engine.speculator.proposer.engine
    assert draft.scheduler.block_manager.num_used_blocks == 0  # each finished request's draft blocks freed
    engine.close()


def test_another_model_as_draft_gives_plain_greedy(target, small_draft, rng):
    prompts = _prompts(rng, 5)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = _engine(target).generate(prompts, params)
    engine = _engine(target, small_draft, max_num_batched_tokens=24)  # prompts prefilled in chunks too
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]
    assert engine.speculative_stats.drafted > 0
    assert engine.speculator.proposer.engine.scheduler.block_manager.num_used_blocks == 0


def test_the_draft_model_drafts_for_every_decoding_request_in_shared_steps(target, small_draft, rng):
    """Five requests decoding together: each step's drafts come from at most k + 1 steps of the draft
    model (a catch-up step of every request's missing tokens, then one batched step per draft
    token), not k per request; and greedy outputs stay plain decoding's."""
    prompts = _prompts(rng, 5)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = _engine(target).generate(prompts, params)
    engine = _engine(target, small_draft, max_num_batched_tokens=256)
    draft = engine.speculator.proposer.engine
    batches: list[int] = []
    execute = draft.runner.execute
    draft.runner.execute = lambda chunks, *a, **kw: (batches.append(len(chunks)), execute(chunks, *a, **kw))[1]
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps = []
    while engine.has_unfinished():
        before = len(batches)
        engine.step()
        steps.append(batches[before:])
    assert max(len(step) for step in steps) <= 4 + 1, steps  # k = 4 draft tokens, one catch-up step
    assert max(batches) >= 3, batches  # several requests shared a draft step
    assert engine.speculative_stats.verifications > 0
    outputs = _engine(target, small_draft, max_num_batched_tokens=256).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    engine.close()


def test_a_draft_with_another_vocabulary_is_refused(target, make_ckpt, compiled):
    other = compiled(make_ckpt("tiny", vocab_size=600), "bf16")
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        _engine(target, other)


def test_draft_model_config_errors():
    with pytest.raises(ValueError, match="draft_model=PATH"):
        SpeculativeConfig("draft-model")
    with pytest.raises(ValueError, match="draft_model=PATH"):
        SpeculativeConfig("prompt-lookup", draft_model="/x")
    config = SpeculativeConfig.parse("draft-model:draft_model=/models/small,num_tokens=3")
    assert (config.method, config.draft_model, config.num_tokens) == ("draft-model", "/models/small", 3)


def test_draft_probs_fill_point_masses_beside_drawn_distributions(rng):
    from qruntime.engine.speculative.verify_step import draft_probs

    vocab = 7
    logits = torch.randn(3, 3, vocab)
    drawn = torch.softmax(torch.randn(2, vocab), -1)
    assert draft_probs([(1,), (2, 3)], [None, None], logits) is None
    out = draft_probs([(1, 4), (2, 3, 5), (6,)], [drawn, None, None], logits)
    assert out.shape == (3, 3, vocab)
    torch.testing.assert_close(out[0, :2], drawn)
    assert out[0, 2].abs().sum() == 0 and out[2, 1:].abs().sum() == 0
    for b, draft in ((1, (2, 3, 5)), (2, (6,))):
        for j, token in enumerate(draft):
            assert out[b, j, token] == 1 and out[b, j].sum() == 1
