"""The scheduler's side of speculative decoding (engine/scheduler.py, step_chunk.py): a decoding
request's chunk carries the drafts the callback gave within its limits, with KV blocks and budget
for them; update() keeps the verified tokens and counts only the accepted drafts' KV as computed.
Hand-traced steps, then random workloads run by a simulated greedy model whose KV cache is a pool of
token ids written and read back through the block tables (rejected drafts' slots included)."""

from __future__ import annotations

import copy
import random
import zlib
from array import array

import pytest
from qruntime.engine.prefix_cache import extend_chain
from qruntime.engine.request import Request
from qruntime.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from qruntime.engine.step_chunk import StepChunk


class Drafter:
    """A draft callback that records what it was asked and answers a fixed draft (cut by nothing)."""

    def __init__(self, tokens: tuple[int, ...] = (101, 102, 103, 104, 105, 106, 107, 108)) -> None:
        self.tokens = tokens
        self.asked: list[tuple[str, int]] = []

    def __call__(self, request: Request, limit: int, grow=None) -> tuple[int, ...]:
        self.asked.append((request.request_id, limit))
        return self.tokens


def _decoding(config: SchedulerConfig, prompts: dict[str, list[int]], max_tokens: int = 10) -> Scheduler:
    """A scheduler whose requests have prefilled and sampled one token each (7): all decoding next."""
    sched = Scheduler(config)
    for rid, prompt in prompts.items():
        sched.add(Request(rid, prompt, max_tokens))
    out = sched.schedule()
    assert all(c.samples for c in out.chunks) and len(out.chunks) == len(prompts)
    sched.update(out, {rid: 7 for rid in prompts})
    return sched


def test_a_decoding_chunk_carries_its_drafts():
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=64))
    sched.add(Request("a", [1, 2, 3, 4, 5], max_tokens=10))
    drafter = Drafter((21, 22, 23))
    prefill = sched.schedule(drafter)
    assert drafter.asked == [] and [c.draft for c in prefill.chunks] == [()]  # no drafts for a prefill
    sched.update(prefill, {"a": 6})
    out = sched.schedule(drafter)
    (chunk,) = out.chunks
    assert drafter.asked == [("a", 8)]  # max_tokens 10, one output: 8 more drafts at most
    assert (chunk.start, chunk.num_tokens, chunk.samples, chunk.draft) == (5, 4, True, (21, 22, 23))
    assert out.num_tokens == 4  # the budget counts the drafts
    assert len(chunk.block_table) == 3 == sched.block_manager.num_used_blocks  # positions 0..8: 3 blocks of 4
    step = StepChunk.of(chunk)
    assert (step.token_ids, step.start, step.block_table) == ((6, 21, 22, 23), 5, chunk.block_table)
    a = sched.get("a")
    assert (a.num_computed_tokens, a.num_pending) == (6, 1)  # the drafts are not computed until verified

    sched.update(out, {"a": [21, 22, 42]})  # two drafts accepted, the third replaced by 42
    assert a.output_token_ids == [6, 21, 22, 42]
    assert (a.num_computed_tokens, a.num_pending) == (8, 0)  # 6 and the accepted 21, 22: positions 5..7
    (after,) = sched.schedule().chunks
    assert (after.start, after.num_tokens, after.draft) == (8, 1, ())  # 42 at position 8; 23's slot written over
    assert StepChunk.of(after).token_ids == (42,)


@pytest.mark.parametrize(
    ("config", "max_tokens", "prompt_len", "limit"),
    [
        (SchedulerConfig(16, 4, 64, max_num_batched_tokens=5), 20, 3, 4),  # the budget, less the token: 5 - 1
        (SchedulerConfig(16, 4, 64), 5, 3, 3),  # max_tokens - outputs - 1: 5 - 1 - 1
        (SchedulerConfig(16, 4, 12), 20, 8, 2),  # max_model_len - tokens - 1: 12 - 9 - 1
    ],
    ids=["budget", "max_tokens", "max_model_len"],
)
def test_the_limit_is_what_the_budget_max_tokens_and_model_length_leave(config, max_tokens, prompt_len, limit):
    sched = _decoding(config, {"a": list(range(1, prompt_len + 1))}, max_tokens)
    drafter = Drafter()  # 8 tokens: more than any limit here
    out = sched.schedule(drafter)
    assert drafter.asked == [("a", limit)]
    (chunk,) = out.chunks
    assert chunk.draft == drafter.tokens[:limit] and chunk.num_tokens == 1 + limit  # cut to the limit
    assert out.num_tokens <= config.max_num_batched_tokens
    a = sched.get("a")
    sched.update(out, {"a": [*chunk.draft, 9]})  # all accepted plus one more: exactly at the limits
    assert len(a.output_token_ids) <= max_tokens and a.num_tokens <= config.max_model_len
    assert a.num_computed_tokens == a.num_tokens - 1


def test_each_request_is_asked_with_the_budget_left_and_none_without_room():
    sched = _decoding(SchedulerConfig(32, 4, 64, max_num_batched_tokens=8), {"a": [1, 2], "b": [3, 4], "c": [5]})
    drafter = Drafter((50, 51))
    out = sched.schedule(drafter)
    assert drafter.asked == [("a", 7), ("b", 4), ("c", 1)]  # each asked with the budget left before it, less 1
    assert [(c.request.request_id, c.num_tokens, c.draft) for c in out.chunks] == [
        ("a", 3, (50, 51)),
        ("b", 3, (50, 51)),
        ("c", 2, (50,)),
    ]
    assert out.num_tokens == 8
    # max_tokens=2 with one output: the token of this step is the last one, no room for a draft
    sched = _decoding(SchedulerConfig(32, 4, 64), {"x": [1, 2]}, max_tokens=2)
    drafter = Drafter()
    out = sched.schedule(drafter)
    assert drafter.asked == [] and [(c.num_tokens, c.draft) for c in out.chunks] == [(1, ())]


def test_no_drafts_for_prefill_chunks_or_pending_tokens():
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=4))
    sched.add(Request("a", list(range(10)), max_tokens=5))
    drafter = Drafter()
    for _ in range(3):  # 4 + 4 + 2 prompt tokens, the last chunk samples
        out = sched.schedule(drafter)
        sched.update(out, {"a": 7} if out.chunks[0].samples else {})
        assert [c.draft for c in out.chunks] == [()]
    assert drafter.asked == []
    sched.schedule()  # decodes 7 (no drafts asked) ...
    second = sched.schedule(drafter)  # ... and, scheduled before the first's update, its pending token
    assert drafter.asked == [] and [(c.start, c.num_tokens, c.draft) for c in second.chunks] == [(11, 1, ())]


def test_no_drafts_without_blocks_for_them_and_nobody_preempted_for_drafts():
    # 4 blocks of 2: a's and b's prompts fill one each; their next tokens need one more each
    sched = _decoding(SchedulerConfig(num_blocks=4, block_size=2, max_model_len=8), {"a": [1, 2], "b": [3, 4]})
    out = sched.schedule(Drafter((50, 51)))
    # a's drafts would take the block b needs for its token: a gets none, and b is not preempted
    assert out.preempted == ()
    assert [(c.request.request_id, c.num_tokens, c.draft) for c in out.chunks] == [("a", 1, ()), ("b", 1, ())]
    # a holds 2 blocks, b 1, one is free: a's 3 drafts would need 2 more, b's as many
    sched = _decoding(SchedulerConfig(num_blocks=4, block_size=2, max_model_len=8), {"a": [1, 2, 3], "b": [4]})
    out = sched.schedule(Drafter((50, 51, 52)))
    assert out.preempted == () and sched.block_manager.num_free_blocks == 1
    assert [(c.request.request_id, c.num_tokens, c.draft) for c in out.chunks] == [("a", 1, ()), ("b", 1, ())]


def _two_decoding(drafts: tuple[int, ...]) -> tuple[SchedulerOutput, Scheduler]:
    """a and b hold a block each of 6 (blocks of 2) and decode position 2, which needs a new block."""
    sched = _decoding(SchedulerConfig(num_blocks=6, block_size=2, max_model_len=12), {"a": [1, 2], "b": [3, 4]})
    return sched.schedule(Drafter(drafts)), sched


def test_drafts_take_only_the_blocks_later_requests_do_not_need():
    # 4 free. a's token and k drafts from position 2 need ceil((3 + k) / 2) - 1 new blocks, and b's token
    # one: k = 5 takes 3, leaving b its one
    out, sched = _two_decoding((50, 51, 52, 53, 54))
    assert [(c.request.request_id, c.num_tokens, c.draft) for c in out.chunks] == [
        ("a", 6, (50, 51, 52, 53, 54)),
        ("b", 1, ()),  # b's own 5 drafts would need 2 more blocks than are left
    ]
    assert out.preempted == () and sched.block_manager.num_free_blocks == 0
    # k = 6 would take b's block: a gets none (and takes 1); b's 6 would need 4 of the 3 left
    out, sched = _two_decoding((50, 51, 52, 53, 54, 55))
    assert [(c.num_tokens, c.draft) for c in out.chunks] == [(1, ()), (1, ())]
    assert out.preempted == () and sched.block_manager.num_free_blocks == 2


def test_update_keeps_accepted_tokens_and_caches_only_their_full_blocks():
    config = SchedulerConfig(num_blocks=16, block_size=2, max_model_len=32, prefix_caching=True)
    sched = Scheduler(config)
    sched.add(Request("a", [1, 2, 3], max_tokens=12))
    out = sched.schedule()
    sched.update(out, {"a": 4})  # [1, 2] cached
    a, bm = sched.get("a"), sched.block_manager
    assert bm.num_cached_blocks == 1
    out = sched.schedule(Drafter((5, 6, 7)))  # 4 at position 3, drafts at 4..6
    assert out.chunks[0].draft == (5, 6, 7)
    sched.update(out, {"a": [5, 9]})  # 5 accepted, 6 rejected (9 instead), 7 never reached
    assert a.output_token_ids == [4, 5, 9] and a.num_computed_tokens == 5
    # positions 0..4 computed: [1, 2], [3, 4] full; [5, 6] holds a rejected draft and is not named
    assert bm.num_cached_blocks == 2
    for tokens in ([1, 2, 3, 4, 5, 6], a.all_token_ids):  # neither the drafted nor the kept tokens name it
        assert bm.lookup(extend_chain([], config.kv_salt, tokens, 2)) == bm.table("a")[:2]
    out = sched.schedule(Drafter((10, 11)))  # 9 at position 5, drafts at 6, 7
    sched.update(out, {"a": [10, 11, 12]})  # all accepted, 12 sampled after them
    assert a.output_token_ids == [4, 5, 9, 10, 11, 12] and a.num_computed_tokens == 8
    assert bm.num_cached_blocks == 4  # [5, 9] and [10, 11] full of accepted tokens now
    chain = extend_chain([], config.kv_salt, a.all_token_ids, 2)
    assert bm.lookup(chain) == bm.table("a")[:4]
    # a new request with a's tokens for a prompt finds those 4 blocks
    sched.add(Request("b", a.all_token_ids, max_tokens=1))
    out = sched.schedule()
    assert [(c.request.request_id, c.start) for c in out.chunks] == [("a", 8), ("b", 8)]


@pytest.mark.parametrize("kept", [[], [50, 51, 52, 9, 10], [51, 9], [9, 50], [50, 9, 10]])
def test_update_refuses_kept_tokens_that_are_not_accepted_drafts_and_one_more(kept):
    sched = _decoding(SchedulerConfig(16, 4, 64), {"a": [1, 2]})
    out = sched.schedule(Drafter((50, 51, 52)))
    with pytest.raises(ValueError, match="are not accepted drafts and one more"):
        sched.update(out, {"a": kept})


def test_step_chunk_of_a_chunk_with_drafts_ends_on_them():
    sched = _decoding(SchedulerConfig(16, 4, 64), {"a": [1, 2, 3], "b": [4]})
    out = sched.schedule(Drafter((50, 51)))
    assert [StepChunk.of(c).token_ids for c in out.chunks] == [(7, 50, 51), (7, 50, 51)]
    assert [StepChunk.of(c).start for c in out.chunks] == [3, 1]


# ---- random workloads: a greedy model, drafts right or wrong, the KV cache a pool of token ids ----


def next_token(context: list[int]) -> int:
    """The simulated model: the next token is a function of the whole context."""
    return zlib.crc32(array("q", context).tobytes()) % 50


def reference_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens and len(prompt) + len(out) < max_model_len:
        out.append(next_token(prompt + out))
    return out


def simulate(config: SchedulerConfig, rng: random.Random, msg: str) -> int:
    """Requests arriving over time (some prompts repeating earlier requests' tokens) run to the end
    with greedy verification of drafts that are each right with some probability; returns how many
    drafts were accepted. Checks, every step: the drafts' limits, the budget, the block tables, that
    every context read back from the pool is the request's tokens (cached blocks and rejected drafts'
    slots included), and that drafts preempt nobody (the same step without drafts preempts as much)."""
    sched, bs = Scheduler(config), config.block_size
    bm = sched.block_manager
    pool: list[list[int | None]] = [[None] * bs for _ in range(config.num_blocks)]
    done: list[Request] = []
    arrivals = [rng.randint(0, 30) for _ in range(rng.randint(4, 9))]
    right = rng.choice([0.3, 0.7, 0.95])
    asked: dict[str, int] = {}

    def draft(request: Request, limit: int, grow=None) -> list[int]:
        assert request.num_pending == 0 and request.num_computed_tokens == request.num_tokens - 1, msg
        assert 1 <= limit <= request.max_tokens - len(request.output_token_ids) - 1, msg
        assert limit <= config.max_model_len - request.num_tokens - 1, msg
        asked[request.request_id] = limit
        truth = reference_output(request.all_token_ids, limit + 2, config.max_model_len + limit + 2)
        return [t if rng.random() < right else (t + 1) % 50 for t in truth[: rng.randint(0, limit + 2)]]

    requests: dict[str, Request] = {}
    accepted_total = step = 0
    while arrivals or sched.has_unfinished():
        step += 1
        where = f"{msg} step={step}"
        assert step < 5000, f"no progress ({where})"
        due = [t for t in arrivals if t <= step][:2]
        for i, t in enumerate(due):
            arrivals.remove(t)
            if done and rng.random() < 0.6:  # an earlier request's tokens and more: its blocks may be cached
                prompt = rng.choice(done).all_token_ids[: config.max_model_len - 2] + [rng.randrange(50)]
            else:
                prompt = [rng.randrange(50) for _ in range(rng.randint(1, 10))]
            request = Request(f"r{step}-{i}", prompt[: config.max_model_len - 1], rng.randint(1, 14))
            requests[request.request_id] = request
            sched.add(request)
        if not sched.has_unfinished():
            continue
        without = copy.deepcopy(sched).schedule()  # the same step without drafts
        asked.clear()
        out = sched.schedule(draft)
        assert set(out.preempted) <= set(without.preempted), f"drafts preempted {out.preempted} ({where})"
        assert 0 < out.num_tokens <= config.max_num_batched_tokens, where
        budget = config.max_num_batched_tokens
        for c in out.chunks:
            rid = c.request.request_id
            if c.draft:
                assert len(c.draft) <= asked[rid] <= budget - 1, where
            budget -= c.num_tokens
            end = c.start + c.num_tokens
            assert c.block_table == bm.table(rid) and len(c.block_table) >= bm.blocks_for(end), where
            others = {b for other in requests if other != rid for b in bm.table(other)}
            for p, token in zip(range(c.start, end), StepChunk.of(c).token_ids, strict=True):
                assert c.block_table[p // bs] not in others, f"{rid} writes a block another holds ({where})"
                pool[c.block_table[p // bs]][p % bs] = token
        sampled: dict[str, int | list[int]] = {}
        for c in out.chunks:
            known = c.start + c.num_tokens - len(c.draft)  # tokens up to the last known one
            context = [pool[c.block_table[p // bs]][p % bs] for p in range(known)]
            assert context == c.request.all_token_ids[:known], f"KV of {c.request.request_id} lost ({where})"
            if not c.samples:
                continue
            kept = []
            for j in range(len(c.draft) + 1):  # greedy verification: row j predicts draft j + 1
                predicted = next_token([pool[c.block_table[p // bs]][p % bs] for p in range(known + j)])
                kept.append(predicted)
                if j == len(c.draft) or c.draft[j] != predicted:
                    break
            accepted_total += len(kept) - 1
            sampled[c.request.request_id] = kept if c.draft else kept[0]
        sched.update(out, sampled)
        for c in out.chunks:
            req = c.request
            if c.samples:
                assert req.num_computed_tokens == req.num_tokens - 1, where  # the accepted drafts only
            if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= config.max_model_len:
                assert len(req.output_token_ids) <= req.max_tokens and req.num_tokens <= config.max_model_len
                sched.finish(req.request_id)
                done.append(req)
    for req in done:
        expected = reference_output(req.prompt_token_ids, req.max_tokens, config.max_model_len)
        assert req.output_token_ids == expected, f"{req.request_id} ({msg})"
    return accepted_total


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_random_workloads_with_drafts(rng, prefix_caching):
    accepted = 0
    for trial in range(60):
        bs = rng.choice([1, 2, 4])
        max_model_len = rng.randint(12, 32)
        num_blocks = -(-max_model_len // bs) + rng.choice([0, 1, 3, 12])  # from barely one request to plenty
        config = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=bs,
            max_model_len=max_model_len,
            max_num_seqs=rng.randint(1, 6),
            max_num_batched_tokens=rng.randint(1, 12),
            prefix_caching=prefix_caching,
        )
        accepted += simulate(config, rng, f"trial={trial} {config}")
    assert accepted > 0


def test_draft_candidates_grow_only_into_blocks_no_running_request_needs():
    # a and b hold a block each of 6 (blocks of 2) and decode position 2 next, a new block each: 2 of
    # the 4 free blocks are reserved whoever asks first
    sched = _decoding(SchedulerConfig(num_blocks=6, block_size=2, max_model_len=12), {"a": [1, 2], "b": [3, 4]})
    candidates = sched.draft_candidates()
    assert [(r.request_id, limit) for r, limit, _ in candidates] == [("a", 8), ("b", 8)]
    (_, _, grow_a), (_, _, grow_b) = candidates
    manager = sched.block_manager
    assert grow_a(3 + 5) is None and manager.num_free_blocks == 4  # 3 more blocks: 1 left of the 2 reserved
    table = grow_a(3 + 3)  # positions 0..5: 2 more blocks, the 2 reserved still free
    assert len(table) == 3 and manager.num_free_blocks == 2
    assert grow_b(3 + 1) is None  # b's own next block is reserved already (it needs 1, 2 are free)
    out = sched.schedule()  # a's grown table holds its token; b takes one of the reserved blocks
    assert out.preempted == () and [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1)]
    assert manager.num_free_blocks == 1


def test_draft_candidates_are_the_requests_about_to_decode_their_last_token():
    sched = _decoding(SchedulerConfig(16, 4, 64), {"a": [1, 2], "b": [3]}, max_tokens=3)
    sched.add(Request("c", [5, 6, 7], max_tokens=4))  # waiting: not a candidate
    assert [(r.request_id, limit) for r, limit, _ in sched.draft_candidates()] == [("a", 1), ("b", 1)]
    sched.schedule()  # a and b decode (their tokens pending), c prefills: none may draft
    assert sched.draft_candidates() == []
