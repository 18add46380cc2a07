"""The engine loop: one thread owns the Engine and steps it while there is work.

HTTP handlers never touch the engine. They `submit` sequences (a command on a lock-guarded inbox)
and read their StreamDeltas from a per-request asyncio queue that the engine thread fills through
`loop.call_soon_threadsafe` (one wake-up per step and event loop). A reader that falls behind takes
everything queued at once, merged per choice (`Handle.get_merged`), so a busy event loop encodes
and sends one chunk per choice per wake-up instead of one per token. `Handle.close()` queues an
abort, which the thread applies before its next step, so a client that goes away frees its KV
blocks within one step. Every client's sequences sit in the one scheduler, so they are batched
together (continuous batching). Admission is bounded: more than `max_waiting` sequences accepted
but not yet running is QueueFull (HTTP 429).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Protocol

from qruntime.engine.engine import Engine
from qruntime.engine.outputs import InvalidRequest, RequestOutput, StreamDelta
from qruntime.serve.protocol import SequenceSpec

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """More sequences wait for admission than the server accepts; try again later."""


class ShuttingDown(Exception):
    """The loop no longer accepts requests (stopping, or its engine failed)."""


@dataclass(frozen=True)
class Failure:
    """Put on a handle's queue instead of a delta when the engine cannot run the request."""

    status: int
    message: str


class FailedRequest(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclass(frozen=True)
class LoopStats:
    """A consistent snapshot for /metrics and /health (sequences, not HTTP requests)."""

    num_waiting: int  # accepted, not yet admitted by the scheduler (new or preempted)
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    alive: bool


class LoopMetrics(Protocol):
    """What the loop reports as it goes (serve.metrics.Metrics); called on the engine thread."""

    def on_added(self, num_prompt_tokens: int) -> None: ...
    def on_step(self, num_sequences: int, num_tokens: int) -> None: ...
    def on_finished(self, output: RequestOutput, submitted: float) -> None: ...


class Handle:
    """One HTTP request's sequences in flight; read with `await get()`, release with `close()`."""

    def __init__(self, owner: EngineLoop, request_id: str, sequences: tuple[SequenceSpec, ...]) -> None:
        self.request_id = request_id
        self.sequences = sequences
        self.engine_ids = tuple(f"{request_id}-{s.index}" for s in sequences)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, StreamDelta] | Failure] = asyncio.Queue()
        self.submitted = time.perf_counter()
        self._owner = owner
        self._remaining = len(sequences)
        self._closed = False
        self._failure: Failure | None = None  # read by get_merged behind deltas; raised on its next call

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
            if delta.finished:
                self._remaining -= 1
            earlier = merged.get(index)
            merged[index] = delta if earlier is None else _joined(earlier, delta)
        if not merged and self._failure is not None:
            return await self.get_merged()
        return list(merged.items())

    @property
    def done(self) -> bool:
        return self._remaining == 0

    def close(self) -> None:
        """Abort whatever has not finished (idempotent; call when the response ends, however it ends)."""
        if not self._closed:
            self._closed = True
            if self._remaining:
                self._owner.abort(self)


def _internal_failure(handle: Handle, what: str | None = None) -> Failure:
    """A 500 naming the request, whose cause is in the server log (never in the response)."""
    cause = f": {what}" if what else ""
    return Failure(500, f"request {handle.request_id} failed in the engine{cause}; the server log has the details")


def _joined(first: StreamDelta, then: StreamDelta) -> StreamDelta:
    return StreamDelta(
        first.request_id, first.token_ids + then.token_ids, first.text + then.text, then.finished, then.output
    )


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class EngineLoop:
    """Owns `engine` on a thread of its own from start() to stop()."""

    def __init__(self, engine: Engine, *, max_waiting: int, metrics: LoopMetrics | None = None) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 (got {max_waiting})")
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.kv_blocks_total = engine.scheduler.config.num_blocks
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Handle | None]] = []  # ("add" | "abort", handle) | ("abort_all", None)
        self._inbox_seqs = 0  # sequences of "add" commands not yet applied
        self._engine_waiting = 0  # the scheduler's numbers, as the thread last published them
        self._engine_running = 0
        self._kv_blocks_used = 0
        self._accepting = True
        self._stopping = False
        self._error: BaseException | None = None
        # engine request id -> (handle, choice index); the engine thread's alone, like the engine
        self._live: dict[str, tuple[Handle, int]] = {}
        self._thread = threading.Thread(target=self._run, name="qruntime-engine", daemon=True)

    # --- any thread ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request_id: str, sequences: tuple[SequenceSpec, ...]) -> Handle:
        """Queue a request's sequences (from a coroutine: deltas go to its event loop)."""
        handle = Handle(self, request_id, sequences)
        with self._cond:
            if not self._accepting or self._error is not None:
                raise ShuttingDown(
                    "the server is shutting down"
                    if self._error is None
                    else "the engine failed and this server must be restarted (its log has the cause)"
                )
            waiting = self._inbox_seqs + self._engine_waiting
            if waiting + len(sequences) > self.max_waiting:
                raise QueueFull(
                    f"{waiting} sequences are waiting (the server accepts at most {self.max_waiting}); retry later"
                )
            self._inbox.append(("add", handle))
            self._inbox_seqs += len(sequences)
            self._cond.notify()
        return handle

    def abort(self, handle: Handle) -> None:
        with self._cond:
            self._inbox.append(("abort", handle))
            self._cond.notify()

    def stats(self) -> LoopStats:
        with self._cond:
            return LoopStats(
                self._inbox_seqs + self._engine_waiting,
                self._engine_running,
                self._kv_blocks_used,
                self.kv_blocks_total,
                self.alive,
            )

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def close(self) -> None:
        """Refuse new requests (ShuttingDown); the accepted ones run on."""
        with self._cond:
            self._accepting = False

    def abort_all(self) -> None:
        """Abort every unfinished sequence (their handles get finish_reason "abort"); the loop runs on."""
        with self._cond:
            self._inbox.append(("abort_all", None))
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, abort every unfinished one (their handles get finish_reason "abort"),
        and end the thread (after the step it may be in). Idempotent."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stopping or engine.has_unfinished()):
                        self._cond.wait()
                    commands, self._inbox = self._inbox, []
                    added = sum(len(h.sequences) for kind, h in commands if kind == "add")
                    self._inbox_seqs -= added
                    self._engine_waiting += added
                    stopping = self._stopping
                for kind, handle in commands:
                    if kind == "add":
                        self._add(handle)
                    elif kind == "abort":
                        self._abort(handle)
                    else:
                        self._abort_all()
                if stopping:
                    break
                if engine.has_unfinished():
                    self._dispatch(engine.step())
                self._publish()
        except BaseException as exc:  # a bug or a device error: fail every request, refuse new ones
            with self._cond:
                self._error = exc
                self._accepting = False
                pending, self._inbox = self._inbox, []
            logger.error("the engine failed; failing %d sequence(s) in flight", len(self._live), exc_info=exc)
            failure = Failure(500, "the engine failed while running this request (the server log has the cause)")
            self._fail_all(failure, [h for kind, h in pending if kind == "add"])
        else:
            self._abort_all()
            self._publish()

    def _add(self, handle: Handle) -> None:
        try:
            for engine_id, spec in zip(handle.engine_ids, handle.sequences, strict=True):
                self.engine.add_request(list(spec.prompt_ids), spec.params, request_id=engine_id)
                self._live[engine_id] = (handle, spec.index)
                if self.metrics is not None:
                    self.metrics.on_added(len(spec.prompt_ids))
        except InvalidRequest as exc:  # the HTTP side checks first; this is the engine's word on it
            self._abort(handle, notify=False)
            self._send({handle.loop: [(handle.queue, Failure(400, str(exc)))]})
        except Exception as exc:  # a bug reached by this request alone: it fails, the engine serves on
            logger.error("request %s could not be added to the engine", handle.request_id, exc_info=exc)
            self._abort(handle, notify=False)
            self._send({handle.loop: [(handle.queue, _internal_failure(handle))]})

    def _abort(self, handle: Handle, notify: bool = True) -> None:
        items = []
        for engine_id in handle.engine_ids:
            entry = self._live.pop(engine_id, None)
            if entry is None:
                continue  # finished already (or never added)
            output = self.engine.abort(engine_id)  # frees its KV blocks now
            if self.metrics is not None:
                self.metrics.on_finished(output, handle.submitted)
            index = entry[1]
            items.append((handle.queue, (index, StreamDelta(engine_id, (), "", True, output))))
        if notify and items:
            self._send({handle.loop: items})

    def _abort_all(self) -> None:
        if self._live:
            logger.warning("shutting down: aborting %d unfinished sequence(s)", len(self._live))
        for handle in dict.fromkeys(handle for handle, _ in self._live.values()):
            self._abort(handle)

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        tokens = 0
        for delta in deltas:
            tokens += len(delta.token_ids)
            entry = self._live.get(delta.request_id)
            if entry is None:
                continue
            handle, index = entry
            if delta.finished:
                del self._live[delta.request_id]
                if self.metrics is not None:
                    self.metrics.on_finished(delta.output, handle.submitted)
                if delta.output.finish_reason == "error":  # the engine failed this sequence alone
                    self._abort(handle, notify=False)  # and so the request: its other choices go too
                    by_loop[handle.loop].append((handle.queue, _internal_failure(handle, delta.output.error)))
                    continue
            by_loop[handle.loop].append((handle.queue, (index, delta)))
        if self.metrics is not None and deltas:
            self.metrics.on_step(len(deltas), tokens)
        self._send(by_loop)

    @staticmethod
    def _send(by_loop: dict[asyncio.AbstractEventLoop, list]) -> None:
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody reads these any more
                loop.call_soon_threadsafe(_deliver, items)

    def _fail_all(self, failure: Failure, pending: list[Handle]) -> None:
        """Send `failure` to every handle in flight and to those still in the inbox."""
        handles = dict.fromkeys([*(handle for handle, _ in self._live.values()), *pending])
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for handle in handles:
            by_loop[handle.loop].append((handle.queue, failure))
        self._live.clear()
        self._send(by_loop)

    def _publish(self) -> None:
        scheduler = self.engine.scheduler
        with self._cond:
            self._engine_waiting = scheduler.num_waiting
            self._engine_running = scheduler.num_running
            self._kv_blocks_used = scheduler.block_manager.num_used_blocks
