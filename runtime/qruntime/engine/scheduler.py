"""Continuous batching with chunked prefill and preemption by recompute (plain Python: no torch).

Each step spends a token budget: running requests first, in admission order (a decode is one
token, an unfinished prefill continues in chunks), then waiting requests in FIFO order. When a
running request cannot get the blocks it needs, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the waiting queue, to recompute
prompt + outputs as its prefill on readmission.

With prefix caching on, a request admitted with nothing computed starts from the longest run of
cached full blocks its tokens name (prefix_cache.py), less at least its last token (whose logits
give the next one): its table starts with those blocks and its first chunk with the token after
them. Blocks a step fills are named in the cache as they complete, so requests sharing a prefix
(and a preempted request coming back) compute only what follows it.

Steps may be scheduled ahead of their results (the engine's async scheduling): schedule() counts a
chunk's tokens as computed at once, and a chunk that samples leaves its request one *pending* token,
sampled on the device, whose id reaches the host with update(). The next step may already decode
it (the model runner takes its id from the device), so a request's chunk can end on pending tokens.
A request whose known and pending outputs reach its max_tokens or the model length is not scheduled
again: the engine finishes it once the pending token is known. A preempted request is readmitted only
once it has no pending token (its recompute needs every id).

Speculative decoding (engine/speculative/): schedule(draft) asks, for each running request about to
decode one token, for draft tokens to verify after it (at most what the step's budget, the request's
max_tokens and the model length leave). Such a chunk computes the token and its k drafts (KV blocks
for all of them); update() gets the tokens the verification kept (accepted drafts, then the one it
added) and counts only the accepted drafts' KV as computed: the rejected ones' slots are written
over by the next step. Drafts never preempt another request: without room for them, none are asked.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from qruntime.engine.block_manager import BlockManager
from qruntime.engine.prefix_cache import ChainMemo, PrefixCacheStats, extend_chain
from qruntime.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the scheduler: KV blocks, model length, and per-step batch size."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step; longer prompts are prefilled in chunks
    prefix_caching: bool = False  # reuse cached full KV blocks across requests (qruntime.load turns it on)
    kv_salt: bytes = b""  # root of the block hash chains: prefix_cache.kv_salt of the artifact's KV encoding
    # names of chain links remembered (prefix_cache.ChainMemo: at most this many links, ~0.5 KB each at
    # block_size 16, and as many names in runs), so requests sharing a prefix do not hash it again; 0: none
    chain_memo_links: int = 16384

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.chain_memo_links < 0:
            raise ValueError(f"chain_memo_links must be >= 0 (got {self.chain_memo_links})")
        # a lone request of max_model_len tokens must fit, or the scheduler could stall for good
        needed = -(-self.max_model_len // self.block_size)
        if self.num_blocks < needed:
            raise ValueError(
                f"num_blocks={self.num_blocks} of block_size={self.block_size} cannot hold one request of "
                f"max_model_len={self.max_model_len} tokens: needs at least {needed} blocks"
            )


@dataclass(eq=False)
class _Sampled:
    """Whether update() has recorded a sampling chunk's token (a step's output is applied once)."""

    done: bool = False


@dataclass(frozen=True)
class ScheduledChunk:
    """The tokens one request computes in one step."""

    request: Request
    start: int  # position of the first token computed this step (request.num_computed_tokens before schedule())
    num_tokens: int  # tokens computed this step: positions start .. start + num_tokens - 1 (the last may be pending)
    block_table: tuple[int, ...]
    samples: bool  # the chunk ends on the request's last token: its logits give the next token
    record: _Sampled | None = None  # of a sampling chunk: set once update() has its token
    epoch: int = 0  # request.num_preemptions at schedule time: a chunk from before a preemption caches nothing
    draft: tuple[int, ...] = ()  # draft tokens verified after the request's last token (its last num_tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step computes, and which requests this schedule() call preempted."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step, over all chunks."""
        return sum(chunk.num_tokens for chunk in self.chunks)


class Scheduler:
    """Decides, step by step, which requests compute which tokens, and owns their KV blocks."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order: the last one is preempted first
        self._hashes: dict[str, list[bytes]] = {}  # hash chains of unfinished requests' full blocks, so far
        self._chain_memo = ChainMemo(config.chain_memo_links if config.prefix_caching else 0)
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (new or preempted)."""
        return len(self._waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        """The running requests, in admission order."""
        return tuple(self._running)

    @property
    def num_running(self) -> int:
        """Admitted requests (they hold KV blocks)."""
        return len(self._running)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests)

    def get(self, request_id: str) -> Request:
        """The unfinished request of that id (KeyError when none)."""
        return self._requests[request_id]

    def add(self, request: Request) -> None:
        """Queue a new request at the back of the waiting queue."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already present")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if len(request.prompt_token_ids) > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {len(request.prompt_token_ids)} tokens is longer "
                f"than max_model_len={self.config.max_model_len}"
            )
        if request.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be >= 1 (got {request.max_tokens})")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not a fresh waiting request")
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def schedule(self, draft: Callable[[Request, int, Callable], Sequence[int]] | None = None) -> SchedulerOutput:
        """Pick this step's chunks (see the module docstring for the policy). draft(request, limit, grow):
        at most `limit` draft tokens to verify after a decoding request's token (speculative decoding);
        grow(n) grows the request's block table to hold n tokens first (None: no room) for a draft that
        writes the KV cache (layer-skip)."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        # blocks the running requests behind each one may need this step (chunks of at most the budget): a
        # request's drafts take only blocks beyond those, so that they never preempt anyone
        behind = self._blocks_behind(budget) if draft is not None else []
        i = 0
        while i < len(self._running) and budget > 0:
            request = self._running[i]
            n = min(self._num_known_and_pending(request) - request.num_computed_tokens, budget)
            if n == 0 or self._at_limit(request):
                i += 1
                continue
            drafts = self._drafts(request, n, budget, draft, behind[i]) if draft is not None else ()
            end = request.num_computed_tokens + n
            if end > self.config.max_model_len:
                raise RuntimeError(
                    f"request {request.request_id!r} would hold {end} tokens of KV, more than "
                    f"max_model_len={self.config.max_model_len} (the engine must finish it at that length)"
                )
            # victims come from the back of the running order, so they were not scheduled yet this step
            while not self.block_manager.can_grow(request.request_id, end):
                victim = self._running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                chunks.append(self._chunk(request, n, draft=drafts))
                budget -= n + len(drafts)
                i += 1

        # admitting while preempting would take blocks that running requests are about to need
        while not preempted and self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting[0]
            if request.num_pending:
                break  # preempted while its last token was in flight: readmitted once the id is known
            cached = self._cached_prefix(request)
            start = len(cached) * self.config.block_size
            n = min(request.num_tokens - start, budget)
            if not self.block_manager.can_grow(request.request_id, start + n, cached):
                break  # first come, first served: nothing behind it may skip ahead
            self._waiting.popleft()
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            if self.config.prefix_caching:
                self.prefix_cache_stats = self.prefix_cache_stats.add(request.num_tokens, start)
            if request.num_cached_prompt_tokens is None:  # its first admission (not a preempted one's return)
                request.num_cached_prompt_tokens = min(start, len(request.prompt_token_ids))
            request.num_computed_tokens = start
            chunks.append(self._chunk(request, n, cached))
            budget -= n

        return SchedulerOutput(chunks=tuple(chunks), preempted=tuple(preempted))

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]) -> None:
        """Record a step's results, in step order: the pending token of each chunk that sampled
        becomes known, and the blocks the step filled are named in the prefix cache.

        sampled maps request ids of chunks with samples=True to their new token (a chunk that
        sampled but is missing got no token: the engine fails that request); a chunk with drafts
        maps to the tokens its verification kept: its accepted drafts, in order, then one more.
        Chunks of requests finished or aborted since schedule() are ignored.
        """
        for chunk in output.chunks:
            request = chunk.request
            if self._requests.get(request.request_id) is not request:
                continue  # finished or aborted meanwhile
            if chunk.samples != (chunk.record is not None) or (chunk.record is not None and chunk.record.done):
                raise ValueError(f"stale chunk for request {request.request_id!r}: update() each output once, in order")
            end = chunk.start + chunk.num_tokens - len(chunk.draft)
            if chunk.samples:
                chunk.record.done = True
                request.num_pending -= 1
                if chunk.draft and request.request_id in sampled:
                    kept = list(sampled[request.request_id])
                    if not 1 <= len(kept) <= len(chunk.draft) + 1 or kept[:-1] != list(chunk.draft[: len(kept) - 1]):
                        raise ValueError(f"request {request.request_id!r}: {kept} are not accepted drafts and one more")
                    request.output_token_ids += kept
                    request.num_computed_tokens += len(kept) - 1  # the accepted drafts' KV is the cache's now
                    end += len(kept) - 1
                elif request.request_id in sampled:
                    request.output_token_ids.append(sampled[request.request_id])
            elif request.request_id in sampled:
                raise ValueError(f"request {request.request_id!r} was sampled mid-prefill (samples=False)")
            if request.status is not RequestStatus.RUNNING or request.num_preemptions != chunk.epoch:
                continue  # preempted since: those blocks are gone, it computes them again on readmission
            full = end // self.config.block_size
            if self.config.prefix_caching and full > chunk.start // self.config.block_size:  # a block filled up
                self.block_manager.cache(request.request_id, self._chain(request, full), full)

    def finish(self, request_id: str) -> None:
        """Mark the request FINISHED, free its blocks, and forget it (KeyError for an unknown id)."""
        request = self._requests.pop(request_id)
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.block_manager.free(request_id)
        self._hashes.pop(request_id, None)
        request.status = RequestStatus.FINISHED

    def abort(self, request_id: str) -> None:
        """Same as finish() for the scheduler; the engine records why."""
        self.finish(request_id)

    def _chunk(
        self, request: Request, n: int, cached: tuple[int, ...] = (), draft: tuple[int, ...] = ()
    ) -> ScheduledChunk:
        start = request.num_computed_tokens
        table = self.block_manager.grow(request.request_id, start + n + len(draft), cached)
        samples = start + n == self._num_known_and_pending(request)
        request.num_computed_tokens = start + n  # in flight from now on: the next schedule() goes on from here
        request.num_pending += samples
        return ScheduledChunk(
            request,
            start,
            n + len(draft),
            table,
            samples,
            _Sampled() if samples else None,
            request.num_preemptions,
            draft,
        )

    def draft_candidates(self) -> list[tuple[Request, int, Callable[[int], tuple[int, ...] | None]]]:
        """The running requests that would decode their last known token next (the ones a step may give
        drafts), each with the most drafts its max_tokens and the model length leave, and a grow(n)
        for a draft that writes the KV cache (layer-skip): the request's block table grown to hold n
        tokens, or None when that would take blocks some running request may need this step. What a
        batching draft method drafts for before `schedule` (which may still give a request fewer
        drafts, or none)."""
        out = []
        reserved = sum(self._blocks_needed(self.config.max_num_batched_tokens))
        for request in self._running:
            start = request.num_computed_tokens
            if request.num_pending or start + 1 != request.num_tokens or self._at_limit(request):
                continue
            limit = min(
                request.max_tokens - len(request.output_token_ids) - 1,
                self.config.max_model_len - request.num_tokens - 1,
            )
            if limit >= 1:
                out.append((request, limit, functools.partial(self._grow_beyond, request.request_id, reserved)))
        return out

    def _grow_beyond(self, request_id: str, reserved: int, num_tokens: int) -> tuple[int, ...] | None:
        """The request's block table grown to hold num_tokens, if that leaves `reserved` blocks free
        (None otherwise: drafts preempt no one)."""
        if self.block_manager.num_missing(request_id, num_tokens) + reserved > self.block_manager.num_free_blocks:
            return None
        return self.block_manager.grow(request_id, num_tokens)

    def _drafts(
        self,
        request: Request,
        n: int,
        budget: int,
        draft: Callable[[Request, int, Callable], Sequence[int]],
        reserved: int,
    ) -> tuple[int, ...]:
        """Draft tokens for a request that decodes its last known token now (none otherwise): at most
        what the step's budget, its max_tokens and the model length leave after the token it adds,
        and only when its blocks can grow for them with `reserved` blocks still free (what the running
        requests behind it may need this step): drafts preempt no one."""
        start = request.num_computed_tokens
        if n != 1 or request.num_pending or start + 1 != request.num_tokens:
            return ()
        limit = min(
            budget - 1,
            request.max_tokens - len(request.output_token_ids) - 1,
            self.config.max_model_len - request.num_tokens - 1,
        )
        if limit < 1:
            return ()

        grow = functools.partial(self._grow_beyond, request.request_id, reserved)
        drafts = tuple(draft(request, limit, grow))[:limit]
        missing = self.block_manager.num_missing(request.request_id, start + 1 + len(drafts))
        if drafts and missing + reserved > self.block_manager.num_free_blocks:
            return ()
        return drafts

    def _blocks_needed(self, budget: int) -> list[int]:
        """For each running request, the blocks its chunk this step (at most `budget` tokens) may need."""
        return [
            0
            if self._at_limit(r)
            else self.block_manager.num_missing(
                r.request_id,
                r.num_computed_tokens + min(self._num_known_and_pending(r) - r.num_computed_tokens, budget),
            )
            for r in self._running
        ]

    def _blocks_behind(self, budget: int) -> list[int]:
        """For each running request, the blocks the running requests after it may need for their
        chunks this step (each at most `budget` tokens)."""
        need = self._blocks_needed(budget)
        return [0, *itertools.accumulate(reversed(need[1:]))][::-1]

    @staticmethod
    def _num_known_and_pending(request: Request) -> int:
        return request.num_tokens + request.num_pending

    def _at_limit(self, request: Request) -> bool:
        """Whether the request's pending token already ends it (max_tokens or the model length)."""
        outputs = len(request.output_token_ids) + request.num_pending
        return bool(request.num_pending) and (
            outputs >= request.max_tokens or self._num_known_and_pending(request) >= self.config.max_model_len
        )

    def _cached_prefix(self, request: Request) -> tuple[int, ...]:
        """Cached blocks holding the request's first tokens, leaving at least its last one to compute."""
        if not self.config.prefix_caching or request.num_computed_tokens or not request.reuse_cached:
            return ()
        limit = (request.num_tokens - 1) // self.config.block_size
        return self.block_manager.lookup(itertools.islice(self._chain(request, limit), limit))

    def _chain(self, request: Request, num_blocks: int) -> list[bytes]:
        """The hash chain of the request's blocks, extended to at least num_blocks full blocks (tokens
        never change, so it is kept until the request finishes: a preemption does not redo it)."""
        chain = self._hashes.setdefault(request.request_id, [])
        if len(chain) < num_blocks:
            bs, n = self.config.block_size, len(request.prompt_token_ids)
            start, end = len(chain) * bs, num_blocks * bs
            # sliced from the prompt and the outputs, not their concatenation: O(new tokens)
            ids = request.prompt_token_ids[start:end]
            if end > n:
                ids += request.output_token_ids[max(start - n, 0) : end - n]
            extend_chain(chain, self.config.kv_salt, ids, bs, request.image_keys, self._chain_memo)
        return chain

    def _preempt(self, request: Request) -> None:
        # recompute, not swap: let go of the KV and prefill prompt + outputs again when readmitted (with
        # prefix caching, from where its blocks still cached end)
        self._running.remove(request)
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self._waiting.appendleft(request)
