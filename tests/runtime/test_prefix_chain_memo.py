"""The hash chain's memo (prefix_cache.ChainMemo) and the block manager's C-speed paths for cached
prefixes: the same names, tables and errors as the plain chain and the block-by-block walk, for
random token lists, including while the memo is full and dropping its oldest links and runs."""

from __future__ import annotations

import pytest
from qruntime.engine.block_manager import BlockManager
from qruntime.engine.prefix_cache import ChainMemo, extend_chain, kv_salt
from qruntime.engine.request import Request
from qruntime.engine.scheduler import Scheduler, SchedulerConfig

SALT = kv_salt({"kv_cache": {"dtype": "bf16", "block_size": 4}})


def _sequences(rng, bs: int, count: int) -> list[list[int]]:
    """Token lists that share random prefixes with earlier ones (a system prompt, a conversation's
    turns, a burst of one prompt), cut at block boundaries and inside blocks, and some fresh."""
    out: list[list[int]] = []
    for _ in range(count):
        if out and rng.random() < 0.8:
            base = rng.choice(out)
            keep = rng.randrange(len(base) + 1)
            tail = [rng.randrange(150_000) for _ in range(rng.randrange(3 * bs))]
            out.append(base[:keep] + tail)
        else:
            out.append([rng.randrange(150_000) for _ in range(rng.randrange(1, 12 * bs))])
    return out


@pytest.mark.parametrize("capacity", [3, 17, 1000])  # tiny: links and runs dropped all the time; large: none
def test_memo_gives_the_plain_chain_names_while_full_and_evicting(rng, capacity):
    bs = rng.choice([1, 2, 4, 16])
    memo = ChainMemo(capacity)
    full = False
    for tokens in _sequences(rng, bs, 60):
        images = ()
        if tokens and rng.random() < 0.2:  # an image taken into the chain at a random position
            images = ((rng.randrange(len(tokens)), rng.randbytes(32)),)
        plain = extend_chain([], SALT, tokens, bs, images)
        assert extend_chain([], SALT, tokens, bs, images, memo) == plain
        split = rng.randrange(len(plain) + 1) * bs  # extended in two calls, as the scheduler does
        part = extend_chain([], SALT, tokens[:split], bs, images, memo)
        assert extend_chain(part, SALT, tokens[split:], bs, images, memo) == plain
        assert len(memo._links) <= capacity and memo._run_names <= capacity
        assert memo._run_names == sum(len(names) for _, names in memo._runs.values())
        full |= len(memo._links) == capacity
    assert full or capacity == 1000  # the small memos were full, so dropping links and runs was exercised


def test_memo_keys_are_whole_bytes_a_changed_token_or_salt_misses(rng):
    bs = 4
    memo = ChainMemo(64)
    tokens = [rng.randrange(150_000) for _ in range(8 * bs)]
    chain = extend_chain([], SALT, tokens, bs, memo=memo)
    for p in (0, rng.randrange(1, len(tokens) - 1), len(tokens) - 1):  # first block, any block, the last
        changed = list(tokens)
        changed[p] ^= 1 << rng.randrange(40)  # one bit of one token, also above the low 32 bits
        other = extend_chain([], SALT, changed, bs, memo=memo)
        assert other == extend_chain([], SALT, changed, bs)
        assert other[: p // bs] == chain[: p // bs] and not set(other[p // bs :]) & set(chain)
    salt = kv_salt({"kv_cache": {"dtype": "fp8_e4m3", "block_size": 4}})
    assert not set(extend_chain([], salt, tokens, bs, memo=memo)) & set(chain)


def test_memo_capacity_is_checked():
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        ChainMemo(-1)
    with pytest.raises(ValueError, match="chain_memo_links must be >= 0"):
        SchedulerConfig(num_blocks=8, block_size=4, max_model_len=16, chain_memo_links=-1)


def _burst(rng, links: int, prefix: list[int], tails: list[list[int]]) -> list:
    """Warm the prefix, then admit a burst sharing it in one step: its chunks, tables and chains."""
    bs = 4
    s = Scheduler(
        SchedulerConfig(
            num_blocks=400,
            block_size=bs,
            max_model_len=256,
            max_num_batched_tokens=256,
            prefix_caching=True,
            kv_salt=SALT,
            chain_memo_links=links,
        )
    )
    warm = Request("warm", prefix + [1] * 5, 4)
    s.add(warm)
    while not warm.output_token_ids:
        out = s.schedule()
        s.update(out, {c.request.request_id: 7 for c in out.chunks if c.samples})
    s.finish("warm")
    for i, tail in enumerate(tails):
        s.add(Request(f"r{i}", prefix + tail, 4))
    out = s.schedule()
    s.update(out, {c.request.request_id: 7 for c in out.chunks if c.samples})
    seen = [(c.request.request_id, c.start, c.num_tokens, c.block_table, c.samples) for c in out.chunks]
    chains = {rid: list(chain) for rid, chain in s._hashes.items()}
    for c in out.chunks:  # each chain is the plain one of the request's tokens
        r = c.request
        chain = chains[r.request_id]
        assert len(chain) == r.num_computed_tokens // bs  # the blocks the step filled
        assert chain == extend_chain([], SALT, r.all_token_ids, bs)[: len(chain)]
    return [seen, chains, s.prefix_cache_stats, s.block_manager.num_cached_blocks]


@pytest.mark.parametrize("links", [2, 16384])
def test_scheduler_with_the_memo_schedules_as_without(rng, links):
    prefix = [rng.randrange(150_000) for _ in range(rng.randrange(20, 60))]
    tails = [[rng.randrange(150_000) for _ in range(rng.randrange(1, 12))] for _ in range(rng.randrange(2, 9))]
    tails.append(list(tails[0]))  # two identical prompts: the second finds the first's names in the memo
    with_memo = _burst(rng, links, prefix, tails)
    assert with_memo == _burst(rng, 0, prefix, tails)
    assert with_memo[2].hits == len(tails) * (len(prefix) // 4 * 4)  # each request found the prefix's blocks


def _named(rng, num_blocks: int, blocks: int, bs: int = 2):
    """A block manager of num_blocks whose request "a" holds `blocks` full blocks of random tokens,
    cached under their chain: (manager, tokens, chain)."""
    bm = BlockManager(num_blocks, bs)
    tokens = [rng.randrange(150_000) for _ in range(blocks * bs)]
    chain = extend_chain([], SALT, tokens, bs)
    bm.grow("a", len(tokens))
    bm.cache("a", chain, len(chain))
    return bm, tokens, chain


def test_cache_checks_the_names_of_blocks_taken_from_the_cache(rng):
    bs = 2
    bm, tokens, chain = _named(rng, 32, 6, bs)
    found = bm.lookup(chain)
    assert found == bm.table("a")
    bm.grow("b", len(tokens) + bs, found)
    wrong = list(chain)
    wrong[rng.randrange(len(chain))] = rng.randbytes(32)  # one found block named otherwise: refused
    with pytest.raises(ValueError, match="cached under another hash"):
        bm.cache("b", wrong + [rng.randbytes(32)], len(chain) + 1)
    bm.cache("b", chain + [b"\x01" * 32], len(chain) + 1)  # the right names: only the new block is named
    assert bm.num_cached_blocks == len(chain) + 1
    assert bm.lookup([*chain, b"\x01" * 32]) == bm.table("b")


def test_grow_does_not_reuse_a_cost_computed_before_a_change(rng):
    """can_grow's cost for a tuple of cached blocks is reused by grow only while nothing changed: a
    request taking those evictable blocks in between makes grow refuse them (they lost their names)."""
    bs = 2
    bm, tokens, chain = _named(rng, 8, 4, bs)
    bm.free("a")  # its 4 named blocks are evictable now
    found = bm.lookup(chain)
    assert len(found) == 4 and bm.can_grow("b", len(tokens) + bs, found)
    bm.grow("c", 8 * bs)  # every block: the evictable ones lose their names
    with pytest.raises(ValueError, match="not distinct cached blocks"):
        bm.grow("b", len(tokens) + bs, found)
    bm.free("c")
    assert bm.lookup(chain) == () and bm.num_free_blocks == 8
