"""The HTTP side's view of the engine: submit a request, read its deltas from a Handle.

A Handle is one HTTP request's sequences in flight, read with `await get_merged()` from a
per-request asyncio queue. A `Router` fills those queues from the engine loop's (request id, item)
batches, one `call_soon_threadsafe` per batch and event loop. A reader that falls behind takes
everything queued at once, merged per choice, so a busy event loop encodes and sends one chunk per
choice per wake-up instead of one per token.

Two engines answer the same calls (`EngineClient`): `InThreadEngine` runs the engine loop on a
thread of this process, and serve/engine_process.py's `EngineProcess` runs it in a process of its
own, so that the engine's host work never waits for the event loop's share of the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Protocol

from qruntime.engine.engine import Engine
from qruntime.engine.outputs import RequestOutput, StreamDelta
from qruntime.engine.prefix_cache import PrefixCacheStats
from qruntime.engine.speculative.speculator import SpeculativeStats
from qruntime.serve.engine_loop import EngineLoop, Failure, Item, LoopMetrics, LoopStats, Submission, internal_failure
from qruntime.serve.protocol import SequenceSpec
from qruntime.tokenizer import IncrementalDetokenizer, TokenIdsOnly, Tokenizer

logger = logging.getLogger(__name__)


class FailedRequest(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class EngineClient(Protocol):
    """What the app asks of an engine, wherever it runs."""

    metrics: LoopMetrics | None

    def start(self) -> None: ...
    def submit(self, request_id: str, sequences: tuple[SequenceSpec, ...]) -> Handle: ...
    def abort(self, handle: Handle) -> None: ...
    def stop_sequence(self, handle: Handle, index: int, num_tokens: int, stop: str) -> None: ...
    def stats(self) -> LoopStats: ...
    @property
    def alive(self) -> bool: ...
    @property
    def prefix_cache_stats(self) -> PrefixCacheStats: ...
    @property
    def speculative_stats(self) -> SpeculativeStats | None: ...
    def close(self) -> None: ...
    def abort_all(self) -> None: ...
    def stop(self, timeout: float | None = None) -> None: ...


@dataclass(eq=False)
class _Text:
    """One sequence's ids turned into text on the HTTP side, and where a stop string ended it."""

    detok: IncrementalDetokenizer
    num_tokens: int = 0  # output tokens read so far (up to the one that completed a stop string)
    stop: str | None = None  # the stop string found: the sequence is ending, its later tokens are dropped


class Handle:
    """One HTTP request's sequences in flight; read with `await get_merged()`, release with `close()`.

    With a `tokenizer`, the handle turns its sequences' token ids into text as its reader takes them
    (the engine sends ids alone: its thread does not spend ~2 ms a step at 256 sequences on text) and
    applies their stop strings: where one completes, the text before it goes out, the tokens after it
    are dropped, and the owner is asked to end that sequence (`stop_sequence`), whose final output is
    then cut to match. Without one, deltas pass as they come (their text is the engine's)."""

    def __init__(
        self,
        owner: Any,
        request_id: str,
        sequences: tuple[SequenceSpec, ...],
        tokenizer: Tokenizer | TokenIdsOnly | None = None,
    ) -> None:
        self.request_id = request_id
        self.sequences = sequences
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.submitted = time.perf_counter()
        self._owner = owner
        self._remaining = len(sequences)
        self._closed = False
        self._failure: Failure | None = None  # read by get_merged behind deltas; raised on its next call
        self._texts: dict[int, _Text] = {}
        if tokenizer is not None:
            for spec in sequences:
                detok = IncrementalDetokenizer(
                    tokenizer,
                    spec.prompt_ids,
                    skip_special_tokens=spec.params.skip_special_tokens,
                    stop=spec.params.stop,
                    min_tokens=spec.params.min_tokens,
                )
                self._texts[spec.index] = _Text(detok)

    @property
    def submission(self) -> Submission:
        return Submission(self.request_id, self.sequences, self.submitted)

    async def get_merged(self) -> list[tuple[int, StreamDelta]]:
        """Every (choice index, delta) queued now, waiting for one if none is: a choice's consecutive
        deltas merged into one (tokens and text joined, the last one's finished and output), in the
        order the choices' first deltas came. Raises FailedRequest when a failure is queued, after
        returning the deltas queued before it."""
        if self._failure is not None:
            self._remaining = 0
            raise FailedRequest(self._failure)
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        merged: dict[int, StreamDelta] = {}
        for item in items:
            if isinstance(item, Failure):
                self._failure = item
                break
            index, delta = item
            try:
                delta = self._with_text(index, delta)
            except Exception:  # the tokenizer failed on this request's ids: it fails alone, as in the engine
                logger.exception("turning request %s's tokens into text failed", self.request_id)
                self._failure = internal_failure(self.request_id, "turning its tokens into text failed")
                self._owner.abort(self)
                break
            if delta is None:
                continue  # a token sampled after a stop string ended its sequence
            if delta.finished:
                self._remaining -= 1
            earlier = merged.get(index)
            merged[index] = delta if earlier is None else _joined(earlier, delta)
        if not merged and self._failure is not None:
            return await self.get_merged()
        return list(merged.items())

    def _with_text(self, index: int, delta: StreamDelta) -> StreamDelta | None:
        """The delta with its text (None to drop it), its stop strings applied (see the class's text)."""
        state = self._texts.get(index)
        if state is None:
            return delta
        if state.stop is not None:  # ending at a stop string: only the end comes through, cut to match
            if not delta.finished:
                return None
            return StreamDelta(delta.request_id, (), "", True, self._stopped(state, delta.output))
        detok, text, ids = state.detok, "", []
        for token in delta.token_ids:
            ids.append(token)
            text += detok.add(token)
            if detok.stop_matched is not None:
                break
        state.num_tokens += len(ids)
        if detok.stop_matched is not None:
            state.stop = detok.stop_matched
            kept = delta.logprobs[: len(ids)]
            if not delta.finished:
                self._owner.stop_sequence(self, index, state.num_tokens, state.stop)
                return StreamDelta(delta.request_id, tuple(ids), text, False, logprobs=kept)
            return StreamDelta(delta.request_id, tuple(ids), text, True, self._stopped(state, delta.output), kept)
        output = delta.output
        if delta.finished:
            if output.finish_reason != "error":
                text += detok.flush()
            output = replace(output, text=detok.text)
        return StreamDelta(delta.request_id, delta.token_ids, text, delta.finished, output, delta.logprobs)

    @staticmethod
    def _stopped(state: _Text, output: RequestOutput) -> RequestOutput:
        if output.finish_reason == "error":
            return output
        return output.stopped_at(state.num_tokens, state.stop, state.detok.text)

    @property
    def done(self) -> bool:
        return self._remaining == 0

    def close(self) -> None:
        """Abort whatever has not finished (idempotent; call when the response ends, however it ends)."""
        if not self._closed:
            self._closed = True
            if self._remaining:
                self._owner.abort(self)


def _joined(first: StreamDelta, then: StreamDelta) -> StreamDelta:
    return StreamDelta(
        first.request_id,
        first.token_ids + then.token_ids,
        first.text + then.text,
        then.finished,
        then.output,
        first.logprobs + then.logprobs,
    )


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class Router:
    """The handles in flight by request id; routes the engine loop's batches to their event loops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[str, Handle] = {}

    def add(self, handle: Handle) -> None:
        with self._lock:
            self._handles[handle.request_id] = handle

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._handles.pop(request_id, None)

    def route(self, items: list[tuple[str, Item]], done: list[str]) -> None:
        """Each item to its request's queue (one call_soon_threadsafe per event loop); `done` forgotten."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        with self._lock:
            for request_id, item in items:
                handle = self._handles.get(request_id)
                if handle is not None:
                    by_loop[handle.loop].append((handle.queue, item))
            for request_id in done:
                self._handles.pop(request_id, None)
        _send(by_loop)

    def fail_all(self, failure: Failure) -> None:
        """`failure` to every handle still in flight (the engine is gone), which are then forgotten."""
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for handle in handles:
            by_loop[handle.loop].append((handle.queue, failure))
        _send(by_loop)


def _send(by_loop: dict[asyncio.AbstractEventLoop, list]) -> None:
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody reads these any more
            loop.call_soon_threadsafe(_deliver, items)


class InThreadEngine:
    """The engine loop on a thread of this process (`qruntime serve --engine thread`, and the tests)."""

    def __init__(
        self, engine: Engine, *, max_waiting: int, metrics: LoopMetrics | None = None, pace_launches: bool = False
    ) -> None:
        self.engine = engine
        self._router = Router()
        self._loop = EngineLoop(
            engine, self._router.route, max_waiting=max_waiting, metrics=metrics, pace_launches=pace_launches
        )
        self.max_waiting = max_waiting

    @property
    def metrics(self) -> LoopMetrics | None:
        return self._loop.metrics

    @metrics.setter
    def metrics(self, value: LoopMetrics | None) -> None:
        self._loop.metrics = value

    def start(self) -> None:
        self._loop.start()

    def submit(self, request_id: str, sequences: tuple[SequenceSpec, ...]) -> Handle:
        """Queue a request's sequences (from a coroutine: deltas go to its event loop)."""
        handle = Handle(self, request_id, sequences, self.engine.tokenizer)
        self._router.add(handle)
        try:
            self._loop.submit(handle.submission)
        except BaseException:
            self._router.discard(request_id)
            raise
        return handle

    def abort(self, handle: Handle) -> None:
        self._loop.abort(handle.request_id)

    def stop_sequence(self, handle: Handle, index: int, num_tokens: int, stop: str) -> None:
        self._loop.stop_sequence(handle.request_id, index, num_tokens, stop)

    def stats(self) -> LoopStats:
        return self._loop.stats()

    @property
    def alive(self) -> bool:
        return self._loop.alive

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.engine.prefix_cache_stats

    @property
    def speculative_stats(self) -> SpeculativeStats | None:
        return self.engine.speculative_stats

    def close(self) -> None:
        self._loop.close()

    def abort_all(self) -> None:
        self._loop.abort_all()

    def stop(self, timeout: float | None = None) -> None:
        self._loop.stop(timeout)
