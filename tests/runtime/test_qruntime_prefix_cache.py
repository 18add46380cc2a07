"""Automatic prefix caching without a model: the hash chain (prefix_cache), reference counts and LRU
eviction (block_manager), and hand-traced scheduler steps that hit, preempt and abort around shared
blocks. test_qruntime_scheduler.py runs random workloads with the cache on; the engine's outputs
with and without it are compared in test_qruntime_engine_prefix_cache.py."""

from __future__ import annotations

import pytest
from qruntime.engine.block_manager import BlockManager, NoFreeBlocks
from qruntime.engine.prefix_cache import PrefixCacheStats, extend_chain, hash_block, kv_salt
from qruntime.engine.request import Request, RequestStatus
from qruntime.engine.scheduler import Scheduler, SchedulerConfig

SALT = kv_salt({"kv_cache": {"dtype": "bf16", "block_size": 4}})


def _chain(tokens: list[int], bs: int = 4, salt: bytes = SALT) -> list[bytes]:
    return extend_chain([], salt, tokens, bs)


# --- the hash chain ----------------------------------------------------------------------------------
def test_chain_same_tokens_same_hashes_a_changed_token_changes_its_block_and_every_later_one(rng):
    bs = rng.choice([1, 2, 4, 16])
    tokens = [rng.randrange(150_000) for _ in range(bs * rng.randint(3, 8) + rng.randrange(bs))]
    chain = _chain(tokens, bs)
    assert len(chain) == len(tokens) // bs and len(set(chain)) == len(chain)  # only full blocks are named
    assert chain == _chain(list(tokens), bs) and all(len(h) == 32 for h in chain)
    grown = extend_chain(_chain(tokens[: 2 * bs], bs), SALT, tokens[2 * bs :], bs)  # block by block == at once
    assert grown == chain
    parent = SALT  # the chain is hash_block's, link by link
    for i, name in enumerate(chain):
        parent = hash_block(parent, tokens[i * bs : (i + 1) * bs])
        assert name == parent, i

    p = rng.randrange(len(chain) * bs)
    changed = list(tokens)
    changed[p] = (changed[p] + 1 + rng.randrange(1000)) % 150_000
    other = _chain(changed, bs)
    first = p // bs
    assert other[:first] == chain[:first]
    assert all(a != b for a, b in zip(other[first:], chain[first:], strict=True))


def test_chain_different_salt_matches_nothing_and_the_salt_is_canonical(rng):
    tokens = [rng.randrange(1000) for _ in range(32)]
    identity = {"kv_cache": {"dtype": "fp8_e4m3", "block_size": 4, "scales": {"k_scale": [0.5, 1.0]}}, "dtype": "bf16"}
    salt = kv_salt(identity)
    assert salt == kv_salt(dict(reversed(list(identity.items()))))  # key order does not matter
    rescaled = {**identity, "kv_cache": {**identity["kv_cache"], "scales": {"k_scale": [0.5, 1.0000001]}}}
    for other in (rescaled, {**identity, "dtype": "float32"}, {**identity, "kv_cache": {}}):
        other_salt = kv_salt(other)
        assert other_salt != salt
        assert not set(_chain(tokens, 4, salt)) & set(_chain(tokens, 4, other_salt))
    # block 0's parent is the salt: its name is hash_block(salt, tokens)
    assert _chain(tokens, 4, salt)[0] == hash_block(salt, tokens[:4])


# --- the block manager: reference counts, eviction, accounting --------------------------------------
def _cached_request(bm: BlockManager, rid: str, tokens: list[int], salt: bytes = SALT) -> tuple[int, ...]:
    """Admit rid with what the cache has of tokens, compute the rest (nothing here) and name its full blocks."""
    chain = _chain(tokens, bm.block_size, salt)
    hits = bm.lookup(chain)
    table = bm.grow(rid, len(tokens), hits)
    bm.cache(rid, chain, len(chain))
    return table


def test_shared_block_is_freed_only_when_its_last_holder_frees_it(rng):
    bm = BlockManager(8, 4)
    prefix = [rng.randrange(1000) for _ in range(8)]
    a = _cached_request(bm, "a", prefix + [1, 2])
    b = _cached_request(bm, "b", prefix + [3, 4, 5, 6, 7])
    assert b[:2] == a[:2] and len(set(a + b)) == 3 + 4 - 2  # b starts with a's two full blocks
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks) == (5, 3, 3)  # a0 a1 b2 named
    bm.free("a")
    assert bm.table("b") == b and bm.num_used_blocks == 4  # the shared blocks stay held by b
    assert bm.lookup(_chain(prefix)) == a[:2]
    bm.free("b")
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks) == (0, 8, 3)
    assert bm.lookup(_chain(prefix + [3, 4, 5, 6])) == b[:3]  # cached, unheld, still found


def test_eviction_takes_uncached_blocks_first_then_least_recently_freed_tail_first():
    bm = BlockManager(6, 2)
    a = _cached_request(bm, "a", [1, 2, 3, 4, 5, 6])  # 3 named blocks
    b = _cached_request(bm, "b", [7, 8, 9, 10, 11])  # 2 named + 1 partial (uncached)
    bm.free("a")
    bm.free("b")
    assert (bm.num_free_blocks, bm.num_cached_blocks) == (6, 5)
    order = []
    for i in range(6):  # one fresh block at a time: what goes, and which prefixes are still found
        order += bm.grow(f"x{i}", 2)
        found = (len(bm.lookup(_chain([1, 2, 3, 4, 5, 6], 2))), len(bm.lookup(_chain([7, 8, 9, 10], 2))))
        assert found == [(3, 2), (2, 2), (1, 2), (0, 2), (0, 1), (0, 0)][i], (i, order)
    # b's partial block (never named) first; then a (freed first) before b, each chain's tail before its head
    assert order == [b[2], a[2], a[1], a[0], b[1], b[0]]
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 0


def test_free_accounting_counts_evictable_blocks_and_charges_revived_hits(rng):
    bm = BlockManager(4, 4)
    tokens = [rng.randrange(1000) for _ in range(8)]
    a = _cached_request(bm, "a", tokens)
    hits = bm.lookup(_chain(tokens))
    assert hits == a
    # held by a: sharing them costs nothing, 2 fresh blocks are left for 16 tokens
    assert bm.can_grow("b", 16, hits) and not bm.can_grow("b", 16) and not bm.can_grow("b", 17, hits)
    bm.free("a")
    assert (bm.num_free_blocks, bm.num_used_blocks) == (4, 0)  # evictable blocks are free: admission is not blocked
    assert bm.can_grow("b", 16) and bm.can_grow("b", 16, hits)  # reviving the hits takes 2 of the 4 free
    with pytest.raises(NoFreeBlocks, match="needs 5 more blocks"):
        bm.grow("c", 20, hits)  # 3 fresh + 2 revived > 4
    assert bm.table("c") == () and (bm.num_free_blocks, bm.num_cached_blocks) == (4, 2)  # nothing changed
    assert bm.grow("c", 16, hits)[:2] == hits and bm.num_free_blocks == 0
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.grow("c", 20, hits)
    with pytest.raises(ValueError, match="not distinct cached blocks"):
        bm.grow("d", 8, (bm.table("c")[3],))  # an unnamed block is no cache hit


def test_a_hash_already_cached_leaves_the_second_block_unnamed(rng):
    bm = BlockManager(4, 4)
    tokens = [rng.randrange(1000) for _ in range(4)]
    assert (bm.grow("a", 4), bm.grow("b", 4)) == ((0,), (1,))  # both compute one block at once (not cached yet)
    bm.cache("a", _chain(tokens), 1)
    bm.cache("b", _chain(tokens), 1)
    assert bm.num_cached_blocks == 1 and bm.lookup(_chain(tokens)) == bm.table("a")
    bm.free("b")  # b's copy was never named: it goes back as a plain free block
    bm.free("a")
    assert bm.grow("c", 12) == (1, 2, 3) and bm.lookup(_chain(tokens)) == (0,)  # the named block is taken last
    with pytest.raises(ValueError, match="cannot cache 4 blocks"):
        bm.cache("c", _chain(tokens * 4), 4)


# --- the scheduler: hits, the cap, preemption and abort with shared blocks ---------------------------
def _sched(num_blocks: int, bs: int = 4, max_model_len: int = 32, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks, bs, max_model_len, 8, budget, prefix_caching=True, kv_salt=SALT))


def _step(sched: Scheduler, token: int = 7) -> tuple[list[tuple[str, int, int]], tuple[str, ...]]:
    out = sched.schedule()
    sched.update(out, {c.request.request_id: token for c in out.chunks if c.samples})
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks], out.preempted


def test_hit_after_a_finished_request_and_counters(rng):
    sched = _sched(16)
    prefix = [rng.randrange(1000) for _ in range(8)]
    sched.add(Request("a", prefix + [1, 2], max_tokens=1))
    assert _step(sched) == ([("a", 0, 10)], ())
    table_a = sched.block_manager.table("a")
    sched.finish("a")
    assert sched.block_manager.num_used_blocks == 0
    sched.add(Request("b", prefix + [3, 4, 5], max_tokens=2))
    assert _step(sched) == ([("b", 8, 3)], ())  # a's two full blocks hold b's first 8 tokens
    assert sched.block_manager.table("b")[:2] == table_a[:2] and sched.get("b").num_computed_tokens == 11
    assert sched.prefix_cache_stats == PrefixCacheStats(queries=10 + 11, hits=8)
    assert sched.prefix_cache_stats.hit_rate == pytest.approx(8 / 21)


def test_hit_is_capped_so_the_last_token_is_computed(rng):
    sched = _sched(16)
    prompt = [rng.randrange(1000) for _ in range(12)]  # an exact multiple of the block size
    sched.add(Request("a", prompt, max_tokens=1))
    _step(sched)
    sched.finish("a")
    sched.add(Request("b", list(prompt), max_tokens=1))
    assert _step(sched) == ([("b", 8, 4)], ())  # all 3 blocks are cached; the last is computed again for its logits
    sched.finish("b")
    sched.add(Request("c", prompt[:1], max_tokens=1))
    assert _step(sched) == ([("c", 0, 1)], ())  # a one-token prompt finds nothing to reuse


def test_preempting_a_request_that_shares_blocks_keeps_them_for_the_other(rng):
    # 6 blocks of 2: a and b share 2 blocks; both grow until b (newest) is preempted
    sched = _sched(6, bs=2, max_model_len=12)
    prefix = [rng.randrange(1000) for _ in range(4)]
    sched.add(Request("a", prefix + [1], max_tokens=7))
    assert _step(sched) == ([("a", 0, 5)], ())
    sched.add(Request("b", prefix + [2], max_tokens=7))
    assert _step(sched) == ([("a", 5, 1), ("b", 4, 1)], ())
    bm = sched.block_manager
    shared = bm.table("a")[:2]
    assert bm.table("b")[:2] == shared
    preempted_at = None
    for step in range(10):
        table_a = bm.table("a")
        chunks, preempted = _step(sched)
        if preempted:
            preempted_at = step
            assert preempted == ("b",) and chunks == [("a", sched.get("a").num_computed_tokens - 1, 1)]
            assert bm.table("a")[: len(table_a)] == table_a  # a's blocks, the shared ones too, are still its own
            assert bm.table("b") == () and sched.get("b").status is RequestStatus.WAITING
            break
    assert preempted_at is not None
    assert bm.lookup(_chain(prefix, 2)) == shared  # still named, and held by a
    while len(sched.get("a").output_token_ids) < 7:  # a runs to its end; b cannot come back before
        start = sched.get("a").num_computed_tokens
        assert _step(sched) == ([("a", start, 1)], ())
    sched.finish("a")
    # b comes back with prompt + its 3 outputs (8 tokens): the shared prefix is still cached (its own
    # third block was evicted for a's growth), so it computes from token 4 on
    assert sched.get("b").num_tokens == 8 and _step(sched) == ([("b", 4, 4)], ())
    assert sched.prefix_cache_stats.hits == 4 + 4


def test_abort_while_shared_only_lets_go(rng):
    sched = _sched(16)
    prefix = [rng.randrange(1000) for _ in range(8)]
    sched.add(Request("a", prefix + [1], max_tokens=4))
    _step(sched)
    sched.add(Request("b", prefix + [2], max_tokens=4))
    assert _step(sched) == ([("a", 9, 1), ("b", 8, 1)], ())
    bm = sched.block_manager
    table_a = bm.table("a")
    sched.abort("b")
    assert bm.table("a") == table_a and bm.num_used_blocks == len(table_a)
    assert _step(sched) == ([("a", 10, 1)], ())
    sched.abort("a")
    assert bm.num_used_blocks == 0 and bm.lookup(_chain(prefix)) == table_a[:2]
    sched.add(Request("c", prefix + [3, 4], max_tokens=1))
    assert _step(sched) == ([("c", 8, 2)], ())


def test_cache_off_finds_nothing(rng):
    sched = Scheduler(SchedulerConfig(16, 4, 32))
    prompt = [rng.randrange(1000) for _ in range(9)]
    for rid in ("a", "b"):
        sched.add(Request(rid, list(prompt), max_tokens=1))
        assert _step(sched) == ([(rid, 0, 9)], ())
        sched.finish(rid)
    assert sched.prefix_cache_stats == PrefixCacheStats() and sched.block_manager.num_cached_blocks == 0
