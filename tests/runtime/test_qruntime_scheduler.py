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
            want = min(req.num_tokens - next_start.get(rid, 0), budget)
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
            assert c.start == next_start.get(rid, 0) and req.num_computed_tokens == end and c.num_tokens >= 1, where
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


def simulate_ahead(config: SchedulerConfig, requests: list[Request], msg: str = "") -> Stats:
    """Run requests to completion as the async engine does: step N+1 is scheduled and run before
    step N's sampled tokens reach the scheduler (update), its decodes reading the tokens N sampled
    "on the device". The pool check proves every chunk read the KV of its true tokens."""
    sched = Scheduler(config)
    bm, bs = sched.block_manager, config.block_size
    for r in requests:
        sched.add(r)
    live = {r.request_id: r for r in requests}
    pool: list[list[int | None]] = [[None] * bs for _ in range(config.num_blocks)]
    device = {r.request_id: list(r.prompt_token_ids) for r in requests}  # every token the device has made
    stats, previous = Stats(), None
    while sched.has_unfinished() or previous is not None:
        stats.steps += 1
        where = f"{msg} step={stats.steps}"
        assert stats.steps < 100_000, f"no progress ({where})"
        out = sched.schedule() if sched.has_unfinished() else None
        stats.preemptions += len(out.preempted) if out else 0
        for rid in out.preempted if out else ():
            device[rid] = list(live[rid].all_token_ids) + device[rid][live[rid].num_tokens :]  # known + pending
        held = [b for rid in live for b in bm.table(rid)]
        assert len(set(held)) == bm.num_used_blocks and (config.prefix_caching or len(held) == len(set(held))), where
        sampled = {}
        for c in out.chunks if out else ():
            rid, req, end = c.request.request_id, c.request, c.start + c.num_tokens
            assert len(req.output_token_ids) < req.max_tokens, f"{rid} scheduled past its max_tokens ({where})"
            assert end <= len(device[rid]) and c.samples == (end == len(device[rid])), where
            assert c.block_table == bm.table(rid) and len(c.block_table) == bm.blocks_for(end), where
            for p in range(c.start, end):
                pool[c.block_table[p // bs]][p % bs] = device[rid][p]
            stats.chunks.setdefault(rid, []).append((c.start, c.num_tokens, c.samples))
        for c in out.chunks if out else ():
            rid = c.request.request_id
            context = [pool[c.block_table[p // bs]][p % bs] for p in range(c.start + c.num_tokens)]
            assert context == device[rid][: len(context)], f"KV of {rid} lost ({where})"
            if c.samples:
                sampled[rid] = next_token(context)
                device[rid].append(sampled[rid])
        if previous is not None:  # the step before: its tokens reach the host now
            prev_out, prev_sampled = previous
            sched.update(prev_out, prev_sampled)
            for rid in prev_sampled:
                finished = rid in live and live[rid].status is RequestStatus.FINISHED
                if rid in live and not finished and len(live[rid].output_token_ids) == live[rid].max_tokens:
                    sched.finish(rid)
        previous = (out, sampled) if out is not None and out.chunks else None
        stats.max_running = max(stats.max_running, sched.num_running)
    assert bm.num_used_blocks == 0, msg
    for r in requests:
        assert r.num_pending == 0 and r.output_token_ids == reference_output(r.prompt_token_ids, r.max_tokens), (
            f"{r.request_id} ({msg})"
        )
    return stats


def random_requests(
    rng: random.Random, n: int, max_model_len: int, leading: list[tuple[int, int]], shared: bool = False
) -> list[Request]:
    """leading (prompt length, max_tokens) shapes, then random ones up to n requests. shared: the
    random ones start with one of three common prefixes (whole prompts repeat too), for cache hits,
    and the last two are one prompt of max_model_len - 1 tokens twice: in a pool of one request's
    blocks (random_config's tight one) each needs every block, so the second runs after the first
    and takes its full blocks from the cache, whatever the random ones before them did (without
    them, ~0.5% of tight workloads had no hit at all: their cached blocks were all evicted)."""
    prefixes = [[rng.randrange(50_000) for _ in range(max_model_len)] for _ in range(3)]
    requests = [Request(f"r{i}", [rng.randrange(50_000) for _ in range(p)], m) for i, (p, m) in enumerate(leading)]
    if shared:
        n -= 2
    while len(requests) < n:
        plen = rng.randint(1, max_model_len - 1)
        ids = [rng.randrange(50_000) for _ in range(plen)]
        if shared:
            common = rng.choice(prefixes)
            ids = common[:plen] if rng.random() < 0.3 else common[: rng.randint(0, plen)] + ids
            ids = ids[:plen]
        requests.append(Request(f"r{len(requests)}", ids, rng.randint(1, max_model_len - plen)))
    if shared:
        last = [rng.randrange(50_000) for _ in range(max_model_len - 1)]
        requests += [Request(f"r{len(requests) + i}", list(last), 1) for i in range(2)]
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


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("plentiful", [False, True])
def test_random_workloads_scheduled_ahead(plentiful, prefix_caching):
    """Async scheduling: the same tokens as one request alone, every KV read right, no step past
    max_tokens (no wasted token), and preemptions while a token is in flight."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    config = random_config(rng, plentiful, prefix_caching)
    msg = f"seed={seed} {config}"
    max_len = config.max_model_len
    leading = [(1, max_len - 1), (1, max_len - 1)]  # tight: two in lockstep to max_model_len, a preemption
    requests = random_requests(rng, 30, max_len, leading, shared=prefix_caching)
    stats = simulate_ahead(config, requests, msg)
    if not plentiful:
        assert stats.preemptions > 0, msg
    for r in rng.sample(requests, 3):
        alone = Request(r.request_id, list(r.prompt_token_ids), r.max_tokens)
        simulate(config, [alone], msg)
        assert alone.output_token_ids == r.output_token_ids, msg


def test_a_pending_token_is_decoded_before_it_is_known():
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=16))
    sched.add(Request("a", [1, 2, 3], max_tokens=3))
    first = sched.schedule()
    assert [(c.start, c.num_tokens, c.samples) for c in first.chunks] == [(0, 3, True)]
    a = sched.get("a")
    assert (a.num_computed_tokens, a.num_pending) == (3, 1)
    second = sched.schedule()  # before update(first): decodes the pending token at position 3
    assert [(c.start, c.num_tokens, c.samples) for c in second.chunks] == [(3, 1, True)] and a.num_pending == 2
    sched.update(first, {"a": 10})
    assert (a.output_token_ids, a.num_pending) == ([10], 1)
    third = sched.schedule()
    assert [(c.start, c.num_tokens, c.samples) for c in third.chunks] == [(4, 1, True)]
    assert sched.schedule().chunks == ()  # one known and two pending tokens make max_tokens=3: nothing more
    sched.update(second, {"a": 11})
    with pytest.raises(ValueError, match="stale"):
        sched.update(second, {"a": 11})
    sched.update(third, {"a": 12})
    assert (a.output_token_ids, a.num_pending, a.num_computed_tokens) == ([10, 11, 12], 0, 5)


def test_a_request_preempted_with_a_pending_token_waits_for_it():
    sched = Scheduler(SchedulerConfig(num_blocks=4, block_size=1, max_model_len=4, max_num_batched_tokens=4))
    sched.add(Request("A", [1, 2], max_tokens=2))
    sched.add(Request("B", [3], max_tokens=3))
    first = sched.schedule()  # A's prompt and B's: 3 blocks, both pending a token
    assert [c.request.request_id for c in first.chunks] == ["A", "B"]
    second = sched.schedule()  # A decodes (4th block); B needs a 5th: B, the newest, is preempted
    assert second.preempted == ("B",) and [c.request.request_id for c in second.chunks] == ["A"]
    b = sched.get("B")
    assert (b.status, b.num_pending) == (RequestStatus.WAITING, 1)
    assert sched.schedule().chunks == ()  # A is at max_tokens; B may not come back before its token is known
    sched.update(first, {"A": 7, "B": 8})
    sched.update(second, {"A": 9})
    sched.finish("A")
    assert b.output_token_ids == [8] and b.num_pending == 0
    third = sched.schedule()  # B recomputes prompt + its known output, and samples
    assert [(c.request.request_id, c.start, c.num_tokens, c.samples) for c in third.chunks] == [("B", 0, 2, True)]


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
