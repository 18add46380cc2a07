"""The engine in a process of its own (`qruntime serve`'s default, as vLLM's engine core).

Why: in one process the engine thread and the event loop that parses requests and encodes the SSE
streams share one GIL. Profiled at 128 streaming clients (bench/serve_profile.py), the two threads
together held ~0.95 of a core: every time the engine thread let the GIL go (a device copy, a
wait) it queued behind the event loop for it, and a decode step's host work grew from well under
its GPU time to about all of it. Here each side has its interpreter.

Protocol, over one duplex pipe (pickled tuples):
  HTTP -> engine: ("add", Submission), ("abort", request id), ("abort_all",), ("stop",);
                  end of file (the HTTP process is gone) stops the engine too. A Submission's
                  images (SequenceSpec.vision: RGB decoded on the HTTP side, CPU uint8 tensors;
                  the engine resizes them on its device) go by torch's multiprocessing pickling:
                  their storage moves to shared memory and the pipe carries a handle.
  engine -> HTTP: ("ready", EngineInfo) once loaded, or ("failed", exception) and exit;
                  then after each turn of the engine loop that changed anything
                  ("out", items, done, metric events, (taken, waiting, running, kv used, alive),
                  PrefixCacheStats, SpeculativeStats or None when not speculating).
The engine process leads a process group of its own, so a Ctrl-C at the terminal (or a signal sent
to the server's group) reaches the HTTP process alone, which drives the graceful shutdown (drain,
then abort, then "stop"); should the HTTP process die, the engine process reads end of file and
exits. If the engine process dies, every request in flight fails with a 500 and /health says 503.
"""

from __future__ import annotations

import atexit
import logging
import logging.config
import os
import pickle
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from qruntime.engine.outputs import RequestOutput
from qruntime.engine.prefix_cache import PrefixCacheStats
from qruntime.engine.speculative.speculator import SpeculativeStats
from qruntime.serve.engine_client import Handle, Router
from qruntime.serve.engine_loop import (
    ENGINE_FAILED,
    EngineLoop,
    LoopMetrics,
    LoopStats,
    ShuttingDown,
    Submission,
    check_admission,
)
from qruntime.serve.engine_spawn import Spawned, spawn_engine
from qruntime.serve.images import ServedVision
from qruntime.serve.protocol import SequenceSpec
from qruntime.tokenizer import TokenIdsOnly, Tokenizer

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # after "stop" (and its timeout), how long the engine process gets to exit before a kill


class EngineProcessError(RuntimeError):
    """The engine process died before it was ready, or could not report why it failed."""


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs of the loaded engine."""

    description: dict[str, Any]
    tokenizer: Tokenizer | TokenIdsOnly
    vocab_size: int
    max_model_len: int
    kv_blocks_total: int
    speculative_stats: SpeculativeStats | None  # None: the engine does not speculate
    vision: ServedVision | None = None  # a Qwen3-VL model's image settings (the encoder stays in the engine process)


class MetricEvents:
    """LoopMetrics that records its calls, for the HTTP process to replay on its Metrics."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_added(self, num_prompt_tokens: int) -> None:
        self.events.append(("added", num_prompt_tokens))

    def on_step(self, num_sequences: int, num_tokens: int) -> None:
        self.events.append(("step", num_sequences, num_tokens))

    def on_finished(self, output: RequestOutput, submitted: float) -> None:
        self.events.append(("finished", output, submitted))

    def drain(self) -> list[tuple[Any, ...]]:
        events, self.events = self.events, []
        return events


def replay(events: list[tuple[Any, ...]], metrics: LoopMetrics) -> None:
    for kind, *args in events:
        getattr(metrics, f"on_{kind}")(*args)


class EngineProcess:
    """The HTTP side of an engine loaded and stepped in a spawned process (see the module's text)."""

    def __init__(
        self,
        load_kwargs: dict[str, Any],
        *,
        max_waiting: int,
        threads: int | None = None,
        setup: Callable[[], None] | None = None,
        log_config: dict[str, Any] | None = None,
        pace_launches: bool = False,
        spawned: Spawned | None = None,
    ) -> None:
        """Spawn the process and wait until it has loaded the engine (an artifact error raised there
        is raised here). `setup`, a picklable callable, runs there first (bench/step_profile.py's timers);
        `log_config` (logging.config.dictConfig's) is the engine process's log, the server's own;
        `pace_launches`: the engine loop's launch pacing (EngineLoop). `spawned`: a process
        engine_spawn.spawn_engine started already with these arguments, taken over instead."""
        if max_waiting < 1:
            if spawned is not None:
                spawned.kill()
            raise ValueError(f"max_waiting must be >= 1 (got {max_waiting})")
        self.max_waiting = max_waiting
        self.metrics: LoopMetrics | None = None
        if spawned is None:
            spawned = spawn_engine(load_kwargs, threads, setup, log_config, pace_launches)
        self._process, self._conn = spawned.process, spawned.conn
        # before multiprocessing's own exit hook (registered earlier, so run later), which would wait
        # for this child forever while our end of its pipe stays open
        atexit.register(self._kill)
        try:
            self.info = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self.tokenizer = self.info.tokenizer
        self.vocab_size = self.info.vocab_size
        self.max_model_len = self.info.max_model_len
        self.description = self.info.description
        self.vision = self.info.vision
        self._router = Router()
        self._send_lock = threading.Lock()
        self._state = threading.Lock()
        self._sent = 0  # sequences sent in "add" commands
        self._published: tuple[int, int, int, int, bool] = (0, 0, 0, 0, True)
        self._prefix_cache_stats = PrefixCacheStats()
        self._speculative_stats = self.info.speculative_stats
        self._accepting = True
        self._gone = False  # the engine process ended (or its loop failed)
        self._reader = threading.Thread(target=self._read, name="qruntime-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> EngineInfo:
        while True:
            ready = wait([self._conn, self._process.sentinel])
            if self._conn in ready:
                try:
                    kind, payload = self._conn.recv()
                except (EOFError, OSError):
                    continue  # it died: the sentinel says so next
                if kind == "ready":
                    return payload
                raise payload
            self._process.join()
            raise EngineProcessError(
                f"the engine process {self._process.pid} died while loading (exit code {self._process.exitcode}); "
                "its error output is above"
            )

    # --- the HTTP side's calls (EngineClient) ---------------------------------------------------------
    def start(self) -> None:
        """Nothing to do: the engine loop runs from the moment the process is ready."""

    def submit(self, request_id: str, sequences: tuple[SequenceSpec, ...]) -> Handle:
        handle = Handle(self, request_id, sequences, self.tokenizer)
        with self._state:
            if not self._accepting or not self.alive:
                raise ShuttingDown(
                    "the server is shutting down"
                    if not self._accepting
                    else "the engine failed and this server must be restarted (its log has the cause)"
                )
            taken, waiting = self._published[:2]
            check_admission(self._sent - taken + waiting, len(sequences), self.max_waiting)
            self._sent += len(sequences)
            self._router.add(handle)
        self._command(("add", handle.submission))
        return handle

    def abort(self, handle: Handle) -> None:
        self._command(("abort", handle.request_id))

    def stop_sequence(self, handle: Handle, index: int, num_tokens: int, stop: str) -> None:
        self._command(("stop_string", handle.request_id, index, num_tokens, stop))

    def stats(self) -> LoopStats:
        with self._state:
            taken, waiting, running, kv_used, _ = self._published
            return LoopStats(self._sent - taken + waiting, running, kv_used, self.info.kv_blocks_total, self.alive)

    @property
    def alive(self) -> bool:
        return not self._gone and self._published[4] and self._process.is_alive()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._prefix_cache_stats

    @property
    def speculative_stats(self) -> SpeculativeStats | None:
        return self._speculative_stats

    def close(self) -> None:
        with self._state:
            self._accepting = False

    def abort_all(self) -> None:
        self._command(("abort_all",))

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, abort the unfinished ones (their readers get finish_reason "abort"),
        and end the engine process: asked to, then killed if it has not exited in time. Idempotent."""
        self.close()
        self._command(("stop",))
        self._process.join(STOP_GRACE_S if timeout is None else timeout)
        self._kill()
        self._reader.join(STOP_GRACE_S)  # it reads what the process sent before it ended, then end of file
        self._conn.close()
        atexit.unregister(self._kill)

    # --- internals ------------------------------------------------------------------------------------
    def _command(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the engine process is gone (or we closed): the reader fails its requests
                pass

    def _read(self) -> None:
        try:
            while True:
                _, items, done, events, published, prefix_cache, speculative = self._conn.recv()  # ("out", ...)
                if self.metrics is not None:
                    replay(events, self.metrics)
                with self._state:
                    self._published = published
                    self._prefix_cache_stats = prefix_cache
                    self._speculative_stats = speculative
                self._router.route(items, done)
        except (EOFError, OSError):
            pass
        except Exception:  # a message we cannot read: as good as the process being gone
            logger.exception("unreadable message from the engine process")
        finally:
            with self._state:
                self._gone = True
            if self._accepting:
                logger.error("the engine process ended (exit code %s); failing requests in flight", self._exit_code())
            self._router.fail_all(ENGINE_FAILED)

    def _exit_code(self) -> int | None:
        self._process.join(1)
        return self._process.exitcode

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(STOP_GRACE_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(STOP_GRACE_S)


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else an EngineProcessError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return EngineProcessError(f"{type(exc).__name__}: {exc}")


def engine_process_main(
    conn: Connection,
    load_kwargs: dict[str, Any],
    threads: int | None,
    setup: Callable[[], None] | None,
    log_config: dict[str, Any] | None,
    pace_launches: bool = False,
) -> None:
    """What the engine process runs: load, report, then run the engine loop on the commands that come."""
    os.setpgid(0, 0)
    if log_config is not None:
        logging.config.dictConfig(log_config)
    if setup is not None:
        setup()
    import torch

    from qruntime.artifact import ArtifactFormatError
    from qruntime.loader import load  # not qruntime.load: engine_spawn.run_engine already reads the weights ahead

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        engine = load(**load_kwargs)
    except BaseException as exc:
        if not isinstance(exc, (ArtifactFormatError, ValueError)):
            traceback.print_exc()  # the HTTP process shows its one line; the detail is here, on the shared stderr
        conn.send(("failed", _portable(exc)))
        return
    info = EngineInfo(
        engine.description,
        engine.tokenizer,
        engine.vocab_size,
        engine.max_model_len,
        engine.scheduler.config.num_blocks,
        engine.speculative_stats,
        ServedVision.of(engine.vision),
    )
    conn.send(("ready", info))
    events = MetricEvents()
    last: list[Any] = [None]

    def sink(items: list, done: list[str]) -> None:
        published = loop.published()
        stats = (engine.prefix_cache_stats, engine.speculative_stats)
        if items or done or events.events or (published, stats) != last[0]:
            last[0] = (published, stats)
            try:
                conn.send(("out", items, done, events.drain(), published, *stats))
            except (OSError, ValueError):
                pass  # the HTTP process is gone; the command reader sees it too and stops the loop

    loop = EngineLoop(engine, sink, metrics=events, pace_launches=pace_launches)
    loop.start()
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "add":
                submission: Submission = message[1]
                try:
                    loop.submit(submission)
                except ShuttingDown:  # the loop failed (its thread has ended): this request fails as those before it
                    sink([(submission.request_id, ENGINE_FAILED)], [submission.request_id])
            elif kind == "abort":
                loop.abort(message[1])
            elif kind == "stop_string":
                loop.stop_sequence(*message[1:])
            elif kind == "abort_all":
                loop.abort_all()
            elif kind == "stop":
                break
    finally:
        loop.stop()
        engine.close()
