"""Automatic prefix caching in the engine (the fp32 reference path on CPU): requests sharing a long
prefix give the same greedy tokens with the cache on and off, submitted at once, one after another
and under preemption; the later ones really hit (the counters, and fewer tokens prefilled); the salt
follows the artifact's KV encoding; the engine's description says whether the cache is on."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import qruntime
import torch
from qruntime import SamplingParams
from qruntime.engine.prefix_cache import PrefixCacheStats, kv_salt
from qruntime.loader import kv_identity
from qruntime.ops.base import KVOp

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
BLOCK = 16  # the tiny artifacts' KV block size (recipe default)


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


def _load(art, prefix_cache: bool, **kwargs):
    kwargs = {"num_kv_blocks": 64, "max_model_len": 128, **kwargs}
    return qruntime.load(art, device="cpu", dtype="float32", prefix_cache=prefix_cache, **kwargs)


def _shared_prefix_prompts(rng: random.Random, vocab: int, count: int, prefix_len: int = 40) -> list[list[int]]:
    """count prompts: one common prefix of prefix_len tokens (2 full blocks and a half), then 1-20 own tokens."""
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for _ in range(count)]


def _record_chunks(engine) -> list[tuple[str, int, int]]:
    """(request id, start, tokens) of every chunk the engine's scheduler hands out from now on."""
    seen: list[tuple[str, int, int]] = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        seen.extend((c.request.request_id, c.start, c.num_tokens) for c in out.chunks)
        return out

    engine.scheduler.schedule = recording
    return seen


def _prefilled(chunks: list[tuple[str, int, int]], request_id: str) -> tuple[int, int]:
    """(first chunk's start, tokens computed in all) of one request."""
    mine = [(start, n) for rid, start, n in chunks if rid == request_id]
    return mine[0][0], sum(n for _, n in mine)


def test_one_after_another_same_tokens_and_the_later_ones_hit(art, rng):
    off = _load(art, prefix_cache=False)
    prompts = _shared_prefix_prompts(rng, off.vocab_size, 4)
    expected = [off.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert off.prefix_cache_stats == PrefixCacheStats() and "prefix cache off" in off.description["kv_cache"]

    on = _load(art, prefix_cache=True)
    assert on.description["prefix_cache"] is True and "prefix cache on" in on.description["kv_cache"]
    chunks = _record_chunks(on)
    outputs = [on.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in outputs] == expected
    first, _ = _prefilled(chunks, outputs[0].request_id)
    assert first == 0
    for p, o in zip(prompts[1:], outputs[1:], strict=True):  # 2 blocks of the common prefix came from the cache
        start, computed = _prefilled(chunks, o.request_id)
        assert start == 2 * BLOCK and computed == len(p) - 2 * BLOCK + len(o.token_ids) - 1
    stats = on.prefix_cache_stats
    assert stats.queries == sum(map(len, prompts)) and stats.hits == 3 * 2 * BLOCK
    assert on.scheduler.block_manager.num_used_blocks == 0 and on.scheduler.block_manager.num_cached_blocks > 0

    again = on.generate([prompts[0]], GREEDY)[0]  # a whole prompt seen before: all but its last token's block
    assert again.token_ids == expected[0]
    assert _prefilled(chunks, again.request_id)[0] == (len(prompts[0]) - 1) // BLOCK * BLOCK
    # each output says how many of its prompt tokens the cache held (usage's cached_tokens)
    cached = [o.num_cached_tokens for o in (*outputs, again)]
    assert cached == [0, *[2 * BLOCK] * (len(prompts) - 1), (len(prompts[0]) - 1) // BLOCK * BLOCK]
    assert all(o.num_cached_tokens == 0 for o in off.generate(prompts, GREEDY))


def test_at_once_with_chunked_prefill_same_tokens_and_hits(art, rng):
    # a 48-token budget: the first prompt's first chunk takes the whole step, so the others are admitted
    # after its full blocks are in the cache
    off = _load(art, prefix_cache=False, max_num_batched_tokens=48)
    prompts = _shared_prefix_prompts(rng, off.vocab_size, 5)
    expected = [o.token_ids for o in off.generate(prompts, GREEDY)]
    on = _load(art, prefix_cache=True, max_num_batched_tokens=48)
    chunks = _record_chunks(on)
    outputs = on.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert on.prefix_cache_stats.hits > 0
    hit = [o.request_id for o in outputs if _prefilled(chunks, o.request_id)[0] > 0]
    assert hit and outputs[0].request_id not in hit


def test_preemption_with_shared_blocks_same_tokens(art, rng):
    # 12 blocks of 16 hold about two of these: requests are preempted, come back, and find their
    # prefix (and their own blocks, unless evicted meanwhile) in the cache
    kwargs = {"num_kv_blocks": 12, "max_model_len": 96, "max_num_batched_tokens": 24}
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    off = _load(art, prefix_cache=False, **kwargs)
    prompts = _shared_prefix_prompts(rng, off.vocab_size, 6, prefix_len=36)
    expected = [o.token_ids for o in off.generate(prompts, params)]
    on = _load(art, prefix_cache=True, **kwargs)
    outputs = on.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.num_preemptions for o in outputs) > 0 and on.prefix_cache_stats.hits > 0
    assert on.scheduler.block_manager.num_used_blocks == 0


def test_score_beside_cached_blocks(art, rng):
    on = _load(art, prefix_cache=True, num_kv_blocks=8)
    prompt = [rng.randrange(on.vocab_size) for _ in range(100)]
    on.generate([prompt], SamplingParams(max_tokens=1))
    assert on.scheduler.block_manager.num_cached_blocks == 6
    logits = on.score(prompt + [1, 2, 3])  # 7 blocks: the 2 uncached free ones, then 5 evicted
    assert logits.shape == (103, on.vocab_size) and on.scheduler.block_manager.num_used_blocks == 0
    off = _load(art, prefix_cache=False, num_kv_blocks=8)
    assert (logits - off.score(prompt + [1, 2, 3])).abs().max().item() == 0.0


def test_the_salt_follows_the_kv_encoding(tiny_ckpt, compiled, art):
    engine = _load(art, prefix_cache=True)
    assert engine.scheduler.config.kv_salt == _load(art, prefix_cache=True).scheduler.config.kv_salt  # stable
    fp8_kv = _load(compiled(tiny_ckpt, "ptpc-fp8", "kv_cache.dtype=fp8_e4m3"), prefix_cache=True)
    assert fp8_kv.scheduler.config.kv_salt != engine.scheduler.config.kv_salt

    manifest_kv = {"dtype": "fp8_e4m3", "scales": {"calibrated": True, "k_scale": [0.5, 0.25], "v_scale": [1.0, 1.0]}}
    plan = fp8_kv.runner.plan
    salt = kv_salt(kv_identity(manifest_kv, torch.float32, plan))
    rescaled = copy.deepcopy(manifest_kv)
    rescaled["scales"]["k_scale"][1] = 0.125
    assert kv_salt(kv_identity(rescaled, torch.float32, plan)) != salt
    # a graph whose attention ops carry another scale for one layer
    nodes = list(plan.nodes)
    i = next(i for i, node in enumerate(nodes) if isinstance(node.op, KVOp))
    op = copy.copy(nodes[i].op)
    op.a = {**op.a, "k_scale": op.a["k_scale"] * 2}
    nodes[i] = SimpleNamespace(op=op)
    other_plan = SimpleNamespace(nodes=nodes)
    assert kv_salt(kv_identity(manifest_kv, torch.float32, other_plan)) != salt
