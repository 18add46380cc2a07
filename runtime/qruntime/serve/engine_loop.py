"""The engine loop: one thread owns the Engine and steps it while there is work.

The loop knows requests by id. `submit` and `abort` are commands on a lock-guarded inbox, which the
thread applies before its next step (so a client that goes away frees its KV blocks within one
step). After each turn the thread hands its `sink` what the turn produced for each request, as
(request id, item) pairs, item a (choice index, StreamDelta) or a Failure, and the ids of the
requests that have nothing more to come. Every request's sequences sit in the one scheduler, so
they are batched together (continuous batching). The engine adds them with detokenize=False: the
deltas carry token ids, which the HTTP side turns into text (engine_client.py's Handle); when it
finds a stop string there, `stop_sequence` ends that sequence here, reported as stopped.

Launch pacing (pace_launches, off by default; `serve --launch-pacing`): after each turn the loop
waits what the engine's `launch_hold` allows (until shortly before the step on the device ends)
before it takes the inbox in, so requests submitted meanwhile join the step launched next instead
of the one after it.

Where the sink leads is the server's choice (serve/engine_client.py): to the requests' asyncio
queues in this process (`InThreadEngine`), or through a pipe to the HTTP process when the loop runs
in an engine process of its own (serve/engine_process.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from qruntime.engine.engine import Engine
from qruntime.engine.outputs import InvalidRequest, RequestOutput, StreamDelta
from qruntime.serve.protocol import SequenceSpec
from qruntime.vision.prompt_images import MultimodalPrompt

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """More sequences wait for admission than the server accepts; try again later."""


class ShuttingDown(Exception):
    """The loop no longer accepts requests (stopping, or its engine failed)."""


@dataclass(frozen=True)
class Failure:
    """Sent for a request instead of its deltas when the engine cannot run it."""

    status: int
    message: str


Item = tuple[int, StreamDelta] | Failure
Sink = Callable[[list[tuple[str, Item]], list[str]], None]  # (request id, item) pairs, ids of requests done


@dataclass(frozen=True)
class Submission:
    """One HTTP request's sequences, as the loop takes them."""

    request_id: str
    sequences: tuple[SequenceSpec, ...]
    submitted: float  # time.perf_counter() when the HTTP side took it (CLOCK_MONOTONIC: one clock per machine)

    @property
    def engine_ids(self) -> tuple[str, ...]:
        return tuple(f"{self.request_id}-{s.index}" for s in self.sequences)


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


def _prompt(spec: SequenceSpec) -> list[int] | MultimodalPrompt:
    """What the engine takes for a sequence: its ids, or with images (decoded on the HTTP side,
    serve/images.py; the engine preprocesses them on its device) the ids and the images."""
    if spec.vision is None:
        return list(spec.prompt_ids)
    return MultimodalPrompt(list(spec.prompt_ids), spec.vision, (), ())


def check_admission(waiting: int, adding: int, max_waiting: int) -> None:
    """QueueFull unless `adding` more sequences fit beside the `waiting` ones."""
    if waiting + adding > max_waiting:
        raise QueueFull(f"{waiting} sequences are waiting (the server accepts at most {max_waiting}); retry later")


def internal_failure(request_id: str, what: str | None = None) -> Failure:
    """A 500 naming the request, whose cause is in the server log (never in the response)."""
    cause = f": {what}" if what else ""
    return Failure(500, f"request {request_id} failed in the engine{cause}; the server log has the details")


ENGINE_FAILED = Failure(500, "the engine failed while running this request (the server log has the cause)")


@dataclass
class _Live:
    submission: Submission
    remaining: int  # sequences not yet finished
    engine_ids: tuple[str, ...] = field(default=())


class EngineLoop:
    """Owns `engine` on a thread of its own from start() to stop(); what it produces goes to `sink`,
    called on that thread once per turn. `max_waiting` bounds admission (None: the caller does)."""

    def __init__(
        self,
        engine: Engine,
        sink: Sink,
        *,
        max_waiting: int | None = None,
        metrics: LoopMetrics | None = None,
        pace_launches: bool = False,
    ) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 (got {max_waiting})")
        self.engine = engine
        self.pace_launches = pace_launches
        self.sink = sink
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.kv_blocks_total = engine.scheduler.config.num_blocks
        self._cond = threading.Condition()
        # ("add", s) | ("abort", id) | ("stop_string", (id, index, num_tokens, stop)) | ("abort_all", None)
        self._inbox: list[tuple[str, Any]] = []
        self._inbox_seqs = 0  # sequences of "add" commands not yet applied
        self._engine_waiting = 0  # the scheduler's numbers, as the thread last published them
        self._engine_running = 0
        self._kv_blocks_used = 0
        self._taken = 0  # sequences of "add" commands applied so far
        self._accepting = True
        self._stopping = False
        self._error: BaseException | None = None
        # the engine thread's alone, like the engine: request id -> its live sequences; engine id -> (request, choice)
        self._requests: dict[str, _Live] = {}
        self._live: dict[str, tuple[str, int]] = {}
        self._out: list[tuple[str, Item]] = []
        self._done: list[str] = []
        self._thread = threading.Thread(target=self._run, name="qruntime-engine", daemon=True)

    # --- any thread ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, submission: Submission) -> None:
        """Queue a request's sequences; ShuttingDown once the loop refuses, QueueFull past max_waiting."""
        with self._cond:
            if not self._accepting or self._error is not None:
                raise ShuttingDown(
                    "the server is shutting down"
                    if self._error is None
                    else "the engine failed and this server must be restarted (its log has the cause)"
                )
            if self.max_waiting is not None:
                check_admission(self._inbox_seqs + self._engine_waiting, len(submission.sequences), self.max_waiting)
            self._inbox.append(("add", submission))
            self._inbox_seqs += len(submission.sequences)
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        """Abort what is unfinished of the request (its deltas say finish_reason "abort"); a no-op once it is done."""
        with self._cond:
            self._inbox.append(("abort", request_id))
            self._cond.notify()

    def stop_sequence(self, request_id: str, index: int, num_tokens: int, stop: str) -> None:
        """End choice `index` of the request at stop string `stop`, which its first num_tokens output
        tokens complete (its reader turns the tokens into text and found it): the sequence is aborted
        in the engine and reported finished with finish_reason "stop"; a no-op once it has ended."""
        with self._cond:
            self._inbox.append(("stop_string", (request_id, index, num_tokens, stop)))
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

    def published(self) -> tuple[int, int, int, int, bool]:
        """(sequences taken in, waiting in the engine, running, KV blocks used, alive), as last published."""
        with self._cond:
            return self._taken, self._engine_waiting, self._engine_running, self._kv_blocks_used, self.alive

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def close(self) -> None:
        """Refuse new requests (ShuttingDown); the accepted ones run on."""
        with self._cond:
            self._accepting = False

    def abort_all(self) -> None:
        """Abort every unfinished sequence (finish_reason "abort"); the loop runs on."""
        with self._cond:
            self._inbox.append(("abort_all", None))
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, abort every unfinished one (finish_reason "abort"), and end the thread
        (after the step it may be in). Idempotent."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        idle = True  # start-up work the load left (graphs captured at first use): done while nothing runs
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stopping or engine.has_unfinished() or idle):
                        self._cond.wait()
                    commands, self._inbox = self._inbox, []
                    added = sum(len(s.sequences) for kind, s in commands if kind == "add")
                    self._inbox_seqs -= added
                    self._engine_waiting += added
                    self._taken += added
                    stopping = self._stopping
                for kind, arg in commands:
                    if kind == "add":
                        self._add(arg)
                    elif kind == "abort":
                        self._abort(arg)
                    elif kind == "stop_string":
                        self._stop_string(*arg)
                    else:
                        self._abort_all()
                if stopping:
                    break
                if engine.has_unfinished():
                    self._dispatch(engine.step())
                elif idle:  # one piece at a time (a capture: ~0.1 s), so a request arriving waits for one alone
                    idle = engine.idle_work()
                self._publish()
                self._flush()
                if self.pace_launches:
                    self._hold(engine.launch_hold())
        except BaseException as exc:  # a bug or a device error: fail every request, refuse new ones
            with self._cond:
                self._error = exc
                self._accepting = False
                pending, self._inbox = self._inbox, []
            logger.error("the engine failed; failing %d sequence(s) in flight", len(self._live), exc_info=exc)
            self._fail_all([s for kind, s in pending if kind == "add"])
            self._flush()
        else:
            self._abort_all()
            self._publish()
            self._flush()

    def _hold(self, seconds: float) -> None:
        """Wait `seconds` before the next turn (launch pacing: the step in flight is far from its end, and
        requests submitted meanwhile join the step launched next), less if the loop is stopping."""
        if seconds <= 0.0:
            return
        deadline = time.perf_counter() + seconds
        with self._cond:
            while not self._stopping and (left := deadline - time.perf_counter()) > 0.0:
                self._cond.wait(left)

    def _add(self, submission: Submission) -> None:
        live = _Live(submission, len(submission.sequences), submission.engine_ids)
        self._requests[submission.request_id] = live
        try:
            for engine_id, spec in zip(live.engine_ids, submission.sequences, strict=True):
                # the ids become text on the HTTP side (serve/engine_client.py's Handle), off this thread
                self.engine.add_request(_prompt(spec), spec.params, request_id=engine_id, detokenize=False)
                self._live[engine_id] = (submission.request_id, spec.index)
                if self.metrics is not None:
                    self.metrics.on_added(len(spec.prompt_ids))
        except InvalidRequest as exc:  # the HTTP side checks first; this is the engine's word on it
            self._fail(submission.request_id, Failure(400, str(exc)))
        except Exception as exc:  # a bug reached by this request alone: it fails, the engine serves on
            logger.error("request %s could not be added to the engine", submission.request_id, exc_info=exc)
            self._fail(submission.request_id, internal_failure(submission.request_id))

    def _abort(self, request_id: str, notify: bool = True) -> None:
        live = self._requests.get(request_id)
        if live is None:
            return  # finished already (or never added)
        for engine_id in live.engine_ids:
            entry = self._live.pop(engine_id, None)
            if entry is None:
                continue  # this choice finished already (or was never added)
            live.remaining -= 1
            try:
                output = self.engine.abort(engine_id)  # frees its KV blocks now
            except KeyError:  # the engine ended it in the step being dispatched (a failed step fails all
                continue  # its sequences): its own delta comes later in this turn, and is dropped with the request
            if self.metrics is not None:
                self.metrics.on_finished(output, live.submission.submitted)
            if notify:
                self._out.append((request_id, (entry[1], StreamDelta(engine_id, (), "", True, output))))
        if notify:
            del self._requests[request_id]
            self._done.append(request_id)

    def _stop_string(self, request_id: str, index: int, num_tokens: int, stop: str) -> None:
        live = self._requests.get(request_id)
        engine_id = f"{request_id}-{index}"
        entry = self._live.pop(engine_id, None) if live is not None else None
        if entry is None:
            return  # it ended meanwhile (its reader cuts that output at the stop string itself)
        output = self.engine.abort(engine_id).stopped_at(num_tokens, stop)  # frees its KV blocks now
        live.remaining -= 1
        if self.metrics is not None:
            self.metrics.on_finished(output, live.submission.submitted)
        self._out.append((request_id, (index, StreamDelta(engine_id, (), "", True, output))))
        if live.remaining == 0:
            del self._requests[request_id]
            self._done.append(request_id)

    def _fail(self, request_id: str, failure: Failure) -> None:
        """The request fails whole: its unfinished sequences are aborted and its reader gets `failure`."""
        self._abort(request_id, notify=False)
        self._requests.pop(request_id, None)
        self._out.append((request_id, failure))
        self._done.append(request_id)

    def _abort_all(self) -> None:
        if self._live:
            logger.warning("shutting down: aborting %d unfinished sequence(s)", len(self._live))
        for request_id in list(self._requests):
            self._abort(request_id)

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        tokens = 0
        for delta in deltas:
            tokens += len(delta.token_ids)
            entry = self._live.get(delta.request_id)
            if entry is None:
                continue
            request_id, index = entry
            live = self._requests[request_id]
            if delta.finished:
                del self._live[delta.request_id]
                live.remaining -= 1
                if self.metrics is not None:
                    self.metrics.on_finished(delta.output, live.submission.submitted)
                if delta.output.finish_reason == "error":  # the engine failed this sequence alone
                    self._fail(request_id, internal_failure(request_id, delta.output.error))  # and so the request
                    continue
            self._out.append((request_id, (index, delta)))
            if live.remaining == 0:
                del self._requests[request_id]
                self._done.append(request_id)
        if self.metrics is not None and deltas:
            self.metrics.on_step(len(deltas), tokens)

    def _fail_all(self, pending: list[Submission]) -> None:
        """ENGINE_FAILED to every request in flight and to those still in the inbox."""
        for request_id in [*self._requests, *(s.request_id for s in pending)]:
            self._out.append((request_id, ENGINE_FAILED))
            self._done.append(request_id)
        self._requests.clear()
        self._live.clear()

    def _flush(self) -> None:
        out, done, self._out, self._done = self._out, self._done, [], []
        self.sink(out, done)

    def _publish(self) -> None:
        scheduler = self.engine.scheduler
        with self._cond:
            self._engine_waiting = scheduler.num_waiting
            self._engine_running = scheduler.num_running
            self._kv_blocks_used = scheduler.block_manager.num_used_blocks
