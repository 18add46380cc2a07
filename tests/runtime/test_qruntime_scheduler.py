"""qruntime.engine.scheduler: hand-traced steps, and random workloads run by a simulated engine whose
KV cache is a pool of token ids written and read back through the block tables (with prefix caching
too: a block found in the cache must hold the tokens its request would have written)."""

import os
import random
import zlib
from array import array
from collections import deque
from dataclasses import dataclass, field

import pytest
from qruntime.engine.prefix_cache import extend_chain
from qruntime.engine.request import Request, RequestStatus
from qruntime.engine.scheduler import Scheduler, SchedulerConfig


def next_token(context: list[int]) -> int:
    """The simulated model: the next token is a function of the whole context."""
    return zlib.crc32(array("q", context).tobytes()) % 1000


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    for _ in range(max_tokens):
        out.append(next_token(prompt + out))
    return out


@dataclass
class Stats:
    steps: int = 0
    preemptions: int = 0
    mixed_steps: int = 0  # steps with a decode chunk and a prefill chunk
    max_running: int = 0
    admissions: list[str] = field(default_factory=list)  # first admissions, in order
    hit_tokens: int = 0  # tokens admissions found in the prefix cache
    chunks: dict[str, list[tuple[int, int, bool]]] = field(default_factory=dict)  # id -> (start, n, samples)


def cached_prefix(sched: Scheduler, request: Request) -> tuple[int, ...]:
    """The blocks a prefix-caching scheduler should start the waiting request's table with (a model
    of the lookup: the request's hash chain, less its last token, looked up in the block manager)."""
    if not sched.config.prefix_caching:
        return ()
    bs = sched.config.block_size
    chain = extend_chain([], sched.config.kv_salt, request.all_token_ids[: request.num_tokens - 1], bs)
    return sched.block_manager.lookup(chain)


def simulate(config: SchedulerConfig, requests: list[Request], msg: str = "") -> Stats:
    """Run requests to completion, checking the scheduler's promises at every step."""
    sched = Scheduler(config)
    bm, bs = sched.block_manager, config.block_size
    for r in requests:
        sched.add(r)
    live = {r.request_id: r for r in requests}
    pool: list[list[int | None]] = [[None] * bs for _ in range(config.num_blocks)]  # the "KV cache"
    waiting, running = deque(live), []  # a model of the scheduler's queues
    next_start: dict[str, int] = {}
    stats = Stats()
    while sched.has_unfinished():
        stats.steps += 1
        where = f"{msg} step={stats.steps}"
        assert stats.steps < 100_000, f"no progress ({where})"
        out = sched.schedule()
        assert 0 < out.num_tokens <= config.max_num_batched_tokens, where
        ids = [c.request.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)) <= config.max_num_seqs, where

        # victims: the most recently admitted, newest first; they go back to the front of the queue
        k = len(out.preempted)
        assert list(out.preempted) == running[::-1][:k], where
        del running[len(running) - k :]
        for rid in out.preempted:
            waiting.appendleft(rid)
            next_start[rid] = 0
            assert live[rid].status is RequestStatus.WAITING and bm.table(rid) == (), where
        stats.preemptions += k

        # running requests first (admission order), then admissions from the front of the queue, none after a preemption
        old = [rid for rid in ids if rid in running]
        new = ids[len(old) :]
        assert old == [rid for rid in running if rid in old] and new == list(waiting)[: len(new)], where
        assert not (k and new), f"admitted in a step that preempted ({where})"
        budget = config.max_num_batched_tokens
        chunk_of = {c.request.request_id: c for c in out.chunks}
        for rid in new:  # admitted at the end of the cached prefix found, a whole number of blocks short of the end
            start = chunk_of[rid].start
            assert start % bs == 0 and start < live[rid].num_tokens, where
            assert config.prefix_caching or start == 0, where
            next_start[rid] = start
            stats.hit_tokens += start
        for rid in running + new:  # each gets all it still needs, up to the budget left
            req = live[rid]
            want = min(req.num_tokens - req.num_computed_tokens, budget)
            assert (chunk_of[rid].num_tokens if rid in chunk_of else 0) == want, f"{rid} ({where})"
            budget -= want
        for rid in new:
            waiting.popleft()
            running.append(rid)
            stats.admissions += [] if rid in stats.chunks else [rid]
        if not k and waiting and budget > 0 and len(running) < config.max_num_seqs:
            head = live[waiting[0]]
            cached = cached_prefix(sched, head)
            start = len(cached) * bs
            end = start + min(head.num_tokens - start, budget)
            assert not bm.can_grow(head.request_id, end, cached), f"under-admitted ({where})"
        assert (sched.num_running, sched.num_waiting) == (len(running), len(waiting)), where
        stats.max_running = max(stats.max_running, len(running))

        # no block in two tables (but cached ones); waiting requests hold none
        held = [b for rid in live for b in bm.table(rid)]
        assert len(set(held)) == bm.num_used_blocks and (config.prefix_caching or len(held) == len(set(held))), where
        assert all(bm.table(rid) == () for rid in waiting), where

        # the simulated forward: write every chunk's tokens, then read each context back
        for c in out.chunks:
            rid, req, end = c.request.request_id, c.request, c.start + c.num_tokens
            assert c.start == next_start.get(rid, 0) == req.num_computed_tokens and c.num_tokens >= 1, where
            assert end <= config.max_model_len and c.samples == (end == req.num_tokens), where
            assert c.block_table == bm.table(rid) and len(c.block_table) == bm.blocks_for(end), where
            others = {b for other in live if other != rid for b in bm.table(other)}
            for p in range(c.start, end):
                assert c.block_table[p // bs] not in others, f"{rid} writes a block another request holds ({where})"
                pool[c.block_table[p // bs]][p % bs] = req.all_token_ids[p]
            stats.chunks.setdefault(rid, []).append((c.start, c.num_tokens, c.samples))
        sampled = {}
        for c in out.chunks:
            context = [pool[c.block_table[p // bs]][p % bs] for p in range(c.start + c.num_tokens)]
            assert context == c.request.all_token_ids[: len(context)], f"KV of {c.request.request_id} lost ({where})"
            if c.samples:
                sampled[c.request.request_id] = next_token(context)
        decode = any(c.start >= len(c.request.prompt_token_ids) and c.num_tokens == 1 for c in out.chunks)
        stats.mixed_steps += decode and any(c.start < len(c.request.prompt_token_ids) for c in out.chunks)

        sched.update(out, sampled)
        for c in out.chunks:
            next_start[c.request.request_id] = c.start + c.num_tokens
        for rid in sampled:
            if len(live[rid].output_token_ids) == live[rid].max_tokens:
                sched.finish(rid)
                running.remove(rid)
                assert live[rid].status is RequestStatus.FINISHED and bm.table(rid) == (), where

    assert bm.num_used_blocks == 0 and not running and not waiting, msg
    for r in requests:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_tokens), f"{r.request_id} ({msg})"
    return stats


def random_requests(
    rng: random.Random, n: int, max_model_len: int, leading: list[tuple[int, int]], shared: bool = False
) -> list[Request]:
    """leading (prompt length, max_tokens) shapes, then random ones up to n requests. shared: the
    random ones start with one of three common prefixes (whole prompts repeat too), for cache hits."""
    prefixes = [[rng.randrange(50_000) for _ in range(max_model_len)] for _ in range(3)]
    requests = [Request(f"r{i}", [rng.randrange(50_000) for _ in range(p)], m) for i, (p, m) in enumerate(leading)]
    while len(requests) < n:
        plen = rng.randint(1, max_model_len - 1)
        ids = [rng.randrange(50_000) for _ in range(plen)]
        if shared:
            common = rng.choice(prefixes)
            ids = common[:plen] if rng.random() < 0.3 else common[: rng.randint(0, plen)] + ids
            ids = ids[:plen]
        requests.append(Request(f"r{len(requests)}", ids, rng.randint(1, max_model_len - plen)))
    return requests


def random_config(rng: random.Random, plentiful: bool, prefix_caching: bool = False) -> SchedulerConfig:
    block_size, max_model_len, max_num_seqs = rng.choice([1, 2, 4, 8]), rng.randint(16, 48), rng.randint(2, 12)
    per_request = -(-max_model_len // block_size)
    num_blocks = max_num_seqs * per_request if plentiful else per_request  # tight: the least allowed
    budget = rng.randint(4, max_model_len // 2)  # some prompts are longer: chunked prefill
    salt = rng.randbytes(32)
    return SchedulerConfig(num_blocks, block_size, max_model_len, max_num_seqs, budget, prefix_caching, salt)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("plentiful", [False, True])
def test_random_workloads(plentiful, prefix_caching):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    config = random_config(rng, plentiful, prefix_caching)
    msg = f"seed={seed} {config}"
    budget, max_len = config.max_num_batched_tokens, config.max_model_len
    chunked = (budget + 1, rng.randint(2, max_len - budget - 1))  # a prompt over the budget
    # plentiful: chunked's prefill ends in step 2 beside (1, 1); step 3 mixes chunked's decode with a new prefill.
    # tight: two requests decoding in lockstep to max_model_len cannot both fit in the blocks: a preemption.
    lockstep = (1, max_len - 1)
    leading = [chunked, (1, 1)] if plentiful else [lockstep, lockstep, chunked]
    requests = random_requests(rng, 30, max_len, leading, shared=prefix_caching)
    stats = simulate(config, requests, msg)
    assert (stats.hit_tokens > 0) == prefix_caching, msg

    assert stats.admissions == [r.request_id for r in requests], f"not FIFO ({msg})"
    assert stats.max_running <= config.max_num_seqs
    if plentiful:
        assert stats.preemptions == 0 and all(r.num_preemptions == 0 for r in requests), msg
        assert stats.mixed_steps > 0, f"no step mixed decode and prefill ({msg})"
    else:
        assert stats.preemptions == sum(r.num_preemptions for r in requests) > 0, msg
    for r in requests:  # prompts over the budget are prefilled in several chunks; only the last one samples
        first_prefill = []
        for start, n, samples in stats.chunks[r.request_id]:
            first_prefill.append(samples)
            if start + n >= len(r.prompt_token_ids):
                break
        assert first_prefill[-1] and not any(first_prefill[:-1]), f"{r.request_id} ({msg})"
        if len(r.prompt_token_ids) - stats.chunks[r.request_id][0][0] > budget:  # less what the cache had
            assert len(first_prefill) >= 2, f"{r.request_id} ({msg})"
    # each request alone produces the same tokens (the reference check inside simulate covers the batch)
    for r in rng.sample(requests, 3):
        alone = Request(r.request_id, list(r.prompt_token_ids), r.max_tokens)
        simulate(config, [alone], msg)
        assert alone.output_token_ids == r.output_token_ids, msg


def _steps(sched: Scheduler, sampled_token: int = 7):
    out = sched.schedule()
    sched.update(out, {c.request.request_id: sampled_token for c in out.chunks if c.samples})
    return [(c.request.request_id, c.start, c.num_tokens, c.samples) for c in out.chunks], out.preempted


def test_chunked_prefill_then_decode_mixed_with_a_new_prefill():
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=8))
    sched.add(Request("long", list(range(20)), max_tokens=5))
    assert _steps(sched) == ([("long", 0, 8, False)], ())
    assert _steps(sched) == ([("long", 8, 8, False)], ())
    sched.add(Request("next", list(range(10)), max_tokens=5))
    assert _steps(sched) == ([("long", 16, 4, True), ("next", 0, 4, False)], ())
    assert _steps(sched) == ([("long", 20, 1, True), ("next", 4, 6, True)], ())
    assert sched.get("long").output_token_ids == [7, 7] and sched.get("long").num_computed_tokens == 21


def test_preemption_newest_first_itself_included_no_admission_then_recompute():
    # block_size 1: blocks == tokens
    sched = Scheduler(SchedulerConfig(num_blocks=6, block_size=1, max_model_len=6, max_num_batched_tokens=3))
    for rid, plen, max_tokens in [("A", 2, 3), ("B", 2, 4), ("C", 1, 5)]:
        sched.add(Request(rid, [1] * plen, max_tokens))
    assert _steps(sched) == ([("A", 0, 2, True), ("B", 0, 1, False)], ())
    assert _steps(sched) == ([("A", 2, 1, True), ("B", 1, 1, True), ("C", 0, 1, True)], ())
    assert sched.block_manager.num_free_blocks == 0
    # A needs a block: C (newest) goes; then B needs one and is itself the newest. 2 blocks free and
    # B could take 1 for a 1-token chunk, but nothing is admitted in a step that preempted.
    assert _steps(sched) == ([("A", 3, 1, True)], ("C", "B"))
    b, c = sched.get("B"), sched.get("C")
    assert (b.status, b.num_computed_tokens, b.num_preemptions, b.output_token_ids) == (
        RequestStatus.WAITING,
        0,
        1,
        [7],
    )
    assert (c.num_preemptions, sched.num_waiting, sched.num_running) == (1, 2, 1)
    sched.finish("A")
    assert sched.block_manager.num_used_blocks == 0
    # B (front of the queue) recomputes prompt + its output as one prefill, then samples
    assert _steps(sched) == ([("B", 0, 3, True)], ())
    assert _steps(sched) == ([("B", 3, 1, True), ("C", 0, 2, True)], ())


def test_fcfs_head_blocks_smaller_requests_behind_it_and_max_num_seqs():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=1, max_model_len=8, max_num_seqs=2))
    for rid, plen in [("A", 6), ("B", 4), ("C", 1)]:
        sched.add(Request(rid, [1] * plen, max_tokens=2))
    assert _steps(sched) == ([("A", 0, 6, True)], ())  # B does not fit; C must not skip ahead
    sched.finish("A")
    assert _steps(sched) == ([("B", 0, 4, True), ("C", 0, 1, True)], ())
    sched.add(Request("D", [1], max_tokens=2))
    assert _steps(sched) == ([("B", 4, 1, True), ("C", 1, 1, True)], ())  # max_num_seqs=2: D waits
    assert (sched.num_running, sched.num_waiting) == (2, 1)


def test_finish_abort_and_stale_chunks():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=2, max_model_len=16))
    sched.add(Request("a", [1, 2, 3], max_tokens=4))
    sched.add(Request("b", [4], max_tokens=4))
    out = sched.schedule()
    assert sched.block_manager.num_used_blocks == 3
    sched.abort("b")  # between schedule() and update(): its chunk is ignored
    sched.update(out, {"a": 9, "b": 9})
    assert sched.get("a").output_token_ids == [9] and sched.block_manager.table("b") == ()
    with pytest.raises(KeyError):
        sched.get("b")
    with pytest.raises(KeyError):
        sched.finish("b")
    with pytest.raises(ValueError, match="stale"):
        sched.update(out, {})  # the same output twice
    sched.add(Request("c", [5] * 5, max_tokens=1))
    sched.finish("c")  # a waiting request
    assert not any(c.request.request_id == "c" for c in sched.schedule().chunks)
    sched.finish("a")
    assert not sched.has_unfinished() and sched.block_manager.num_used_blocks == 0


def test_validation():
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=4, max_model_len=16))
    sched.add(Request("x", [1], max_tokens=1))
    with pytest.raises(ValueError, match="already present"):
        sched.add(Request("x", [1], max_tokens=1))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(Request("e", [], max_tokens=1))
    with pytest.raises(ValueError, match="17 tokens is longer than max_model_len=16"):
        sched.add(Request("l", [1] * 17, max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add(Request("m", [1], max_tokens=0))
    assert sched.num_waiting == 1
    with pytest.raises(ValueError, match="needs at least 5 blocks"):
        SchedulerConfig(num_blocks=4, block_size=4, max_model_len=17)
    for bad in ({"num_blocks": 0}, {"block_size": 0}, {"max_model_len": 0}, {"max_num_seqs": 0}):
        with pytest.raises(ValueError, match=">= 1"):
            SchedulerConfig(**({"num_blocks": 4, "block_size": 4, "max_model_len": 16} | bad))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(4, 4, 16, max_num_batched_tokens=0)
