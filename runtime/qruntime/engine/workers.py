"""Rank 0's handle on a tensor-parallel engine's other ranks: N-1 spawned worker processes, each
holding its shard of the model (engine/worker_process.py is what runs in them).

Protocol. Rank 0 serves a TCP store on a free port of 127.0.0.1 only (the process group's
rendezvous; `serve_store`) and spawns the workers ("spawn" context), each with one duplex pipe. Once
every rank is built (the "ready" checkpoint: in the process group, its collectives run) the store
stops listening: the ranks keep the connections they made, and no other process can connect. Every rank builds its runner
(qruntime.rank.build_rank); at each build checkpoint rank 0 waits until every worker has reported
it. Then each step is pickled once and written to every pipe before rank 0 runs it itself; the
graphs' collectives keep the ranks in lockstep. No reply per step: a worker only speaks to report
its failure. Rank 0 need not wait for a step's end before sending the next (async scheduling): it
waits when it reads the step's tokens (`settle`), where a failure is raised as the step's own. A
Qwen3-VL step holding image rows sends their embeddings in a broadcast over the group right after
the message (engine/vision_share.py), not through the pipes.

Failures. Rank 0 never waits on a worker without watching it: checkpoints wait on the pipes and the
processes' sentinels together (bounded); before a step, a dead worker is an error; when rank 0's
step fails (gloo reports a peer that went away; on CUDA a watcher thread aborts the NCCL group when
a worker dies, which would otherwise leave rank 0 blocked), the failed worker's traceback, or its
exit code, becomes a WorkerError naming its rank. Any failure stops every worker (the ranks are out
of step) and closes the engine. `close()`, also run by a finaliser when the engine is collected and
at exit, asks the workers to leave and destroys the process group.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qruntime.artifact import ArtifactFormatError
from qruntime.engine.sharded_sampler import ShardedSampling, finish_step
from qruntime.engine.vision_share import send_embeds, without_embeds
from qruntime.engine.worker_process import Report, share_cores, worker_main
from qruntime.rank import RankConfig

if TYPE_CHECKING:
    from qruntime.engine.model_runner import ModelRunner
    from qruntime.engine.step_chunk import StepChunk

LOAD_TIMEOUT_S = 3600.0  # longest wait for the workers at one build checkpoint (weights of a large model)
CLOSE_TIMEOUT_S = 30.0  # a closing worker gets this long to leave before it is terminated
FAILURE_GRACE_S = 3.0  # after an error on rank 0, how long to wait for a failing worker's report
CLOSE = pickle.dumps(("close",))
T = TypeVar("T")


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed (raised, died, or stopped answering): `rank` is its rank,
    `worker_traceback` the traceback it sent ("" when it sent none). The engine is closed."""

    def __init__(self, rank: int, message: str, worker_traceback: str = "", in_collective: bool = False) -> None:
        text = f"tensor-parallel rank {rank} failed: {message}"
        if worker_traceback:
            text += f"\n--- traceback of rank {rank} ---\n{worker_traceback.rstrip()}"
        super().__init__(text)
        self.rank = rank
        self.worker_traceback = worker_traceback
        self.in_collective = in_collective  # raised in a collective: likely the echo of another rank's failure

    @classmethod
    def of(cls, rank: int, report: Report) -> WorkerError:
        return cls(rank, report.summary, report.traceback, report.in_collective)


def _died(rank: int, process: Any) -> WorkerError:
    process.join(1)
    code = process.exitcode
    how = f"exit code {code}" if code is None or code >= 0 else f"signal {signal.Signals(-code).name}"
    return WorkerError(rank, f"its process {process.pid} died ({how}) without a report")


@dataclass
class _State:
    """What shutting down needs; the finaliser holds it, never the Workers object itself."""

    processes: list[Any] = field(default_factory=list)  # of rank 1, 2, ...
    conns: list[Connection] = field(default_factory=list)
    nccl: bool = False
    store: Any = None
    listener: socket.socket | None = None  # our handle on the store's listening socket (serve_store)
    watcher: threading.Thread | None = None
    wake_watcher: Connection | None = None
    closing: bool = False
    on_death: list[Callable[[], None]] = field(default_factory=list)  # run by the watcher when a worker dies
    threads: int | None = None  # this process's torch threads before rank 0 took its share (CPU only)


def serve_store(world_size: int) -> tuple[dist.TCPStore, socket.socket]:
    """Rank 0's rendezvous store, listening on 127.0.0.1 only, and our handle on its listening socket.

    torch's TCPStore(host, port, is_master=True) listens on every interface whatever `host` says
    (torch 2.13: [::]:port, seen in /proc/net/tcp6), so the socket is made here, bound to loopback,
    and handed to the store through `master_listen_fd` as a duplicate (the store closes its copy when
    it is destroyed). `stop_listening(handle)` ends the listening once every rank has connected."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        fd = os.dup(listener.fileno())
        try:
            store = dist.TCPStore(
                "127.0.0.1",
                listener.getsockname()[1],
                world_size,
                is_master=True,
                wait_for_workers=False,
                master_listen_fd=fd,
                use_libuv=True,
            )
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
    except BaseException:
        listener.close()
        raise
    return store, listener


def stop_listening(listener: socket.socket) -> None:
    """Stop the store's socket from accepting connections (the store's copy of it too: shutdown acts
    on the socket, not the descriptor); the connections made before keep working."""
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)
    listener.close()


def _shutdown(state: _State, graceful: bool) -> None:
    """Stop every worker (asked to leave when graceful, else terminated), then rank 0's group."""
    state.closing = True
    if state.listener is not None:
        stop_listening(state.listener)
        state.listener = None
    if state.wake_watcher is not None:
        with contextlib.suppress(OSError):
            state.wake_watcher.send_bytes(b"")
    if graceful:
        for conn in state.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(CLOSE)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for process in state.processes:
            process.join(max(deadline - time.monotonic(), 0))
    for process in state.processes:
        if process.is_alive():
            process.terminate()
    for process in state.processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in state.conns:
        conn.close()
    if state.watcher is not None:
        state.watcher.join()
    if dist.is_initialized():
        if state.nccl:
            # the workers are gone: NCCL's destroy would wait for peers that no longer exist (seen on
            # 4 x H200: close hung), and pending collectives must not be waited for either; abort
            # frees the communicators at once and clears the default group for the next load
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    state.store = None
    if state.threads is not None:  # the caller's thread count back
        torch.set_num_threads(state.threads)
        state.threads = None


def _watch(sentinels: list[int], wake: Connection, state: _State) -> None:
    """CUDA: a worker that dies leaves rank 0 blocked in an NCCL collective; abort the group to free it."""
    wait([*sentinels, wake])
    if state.closing:
        return
    for release in state.on_death:  # e.g. the custom all-reduce's kernels stop waiting for the dead rank
        with contextlib.suppress(Exception):
            release()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.distributed_c10d._abort_process_group()


class Workers:
    """Rank 0's handle on the workers of ranks 1..tp-1 (see the module docstring)."""

    def __init__(self, config: RankConfig) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "this process already has a torch.distributed default process group; a tensor-parallel engine "
                "makes its own: load it in a process without one (one tp engine per process at a time)"
            )
        self._state = state = _State(nccl=config.device.type == "cuda")
        if not state.nccl:
            state.threads = torch.get_num_threads()
            torch.set_num_threads(share_cores(config.tp))
        self._finalizer = weakref.finalize(self, _shutdown, state, True)
        self.failure: str | None = None  # why the workers were stopped, when an error stopped them
        context = mp.get_context("spawn")
        try:
            state.store, state.listener = serve_store(config.tp)
            for rank in range(1, config.tp):
                ours, theirs = context.Pipe()
                state.conns.append(ours)
                process = context.Process(
                    target=worker_main, args=(rank, config, state.store.port, theirs), name=f"qruntime-tp{rank}"
                )
                process.daemon = True  # multiprocessing terminates it at exit if nothing else did
                process.start()
                theirs.close()
                state.processes.append(process)
        except BaseException:
            self._finalizer.detach()
            _shutdown(state, graceful=False)
            raise
        if state.nccl:
            wake, state.wake_watcher = context.Pipe(duplex=False)
            sentinels = [p.sentinel for p in state.processes]
            state.watcher = threading.Thread(target=_watch, args=(sentinels, wake, state), daemon=True)
            state.watcher.start()

    @property
    def store(self) -> dist.TCPStore:
        """The rendezvous of the ranks' process group (rank 0 serves it)."""
        return self._state.store

    @property
    def closed(self) -> bool:
        return self._state.closing

    def _ranks(self) -> list[tuple[int, Any, Connection]]:
        return [(r, p, c) for r, (p, c) in enumerate(zip(self._state.processes, self._state.conns, strict=True), 1)]

    def checkpoint(self, tag: str) -> None:
        """Wait until every worker reports `tag` (build_rank's checkpoints); a worker's error or death
        meanwhile is a WorkerError, and so is a wait beyond LOAD_TIMEOUT_S. After "ready" (every
        rank built, its communicators made and used) the store stops listening."""
        self._wait_for(tag)
        if tag == "ready" and self._state.listener is not None:
            stop_listening(self._state.listener)
            self._state.listener = None

    def _wait_for(self, tag: str) -> None:
        pending = {rank: (process, conn) for rank, process, conn in self._ranks()}
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while pending:
            ready = wait([x for p, c in pending.values() for x in (c, p.sentinel)], deadline - time.monotonic())
            if not ready:
                raise WorkerError(min(pending), f"did not reach {tag!r} within {LOAD_TIMEOUT_S:.0f} s")
            for rank, (process, conn) in list(pending.items()):
                if conn not in ready and process.sentinel not in ready:
                    continue
                try:
                    kind, payload = conn.recv() if conn.poll() else ("died", None)
                except (EOFError, OSError):
                    kind, payload = "died", None
                if kind == tag:
                    del pending[rank]
                    continue
                if kind == "error":
                    error = WorkerError.of(rank, payload)
                elif kind == "died":
                    error = _died(rank, process)
                else:
                    error = WorkerError(rank, f"sent {kind!r} while rank 0 waited for {tag!r}")
                raise self._find_failure(FAILURE_GRACE_S, error)

    def on_death(self, release: Callable[[], None]) -> None:
        """Call `release` (from the watcher thread, on CUDA) as soon as a worker process dies."""
        self._state.on_death.append(release)

    def step(
        self,
        runner: ModelRunner,
        chunks: Sequence[StepChunk],
        all_logits: bool | Sequence[bool],
        sampling: ShardedSampling | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        sampled: torch.Tensor | None = None,
        settle: bool = True,
        shared: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Send the step to every worker, then run it on rank 0's runner: rank 0's logits, whole rows
        (gathered from the ranks when each holds a vocabulary shard); or with `sampling` (sharded
        sampling, `generators` rank 0's), the sampled token ids and row maxima.

        `sampled`: rank 0's token ids of the step before, which the chunks' pending ids name (each
        worker holds its own copy of them: async scheduling). `settle`: wait for the device here, so
        that a failed collective or a dead worker is raised by this call; without it the caller
        waits later, through `settle()`. `shared`: rank 0 will send the workers its `shared` sampled
        token ids of this step (sharded_sampler.share_tokens) once it has sampled the gathered rows."""
        with self._as_step():
            self._check_alive()
            # a Qwen3-VL step's image rows: their embeddings go in a broadcast after the message, not in it
            sent, rows = without_embeds(chunks)
            self._send(("step", sent, all_logits, sampling, shared, rows))
            if rows:
                assert runner.vision is not None
                send_embeds(chunks, rows, *runner.vision, runner.device)
            logits = runner.execute(chunks, all_logits, sampled=sampled)
            result = finish_step(runner.vocab_shard, logits, sampling, generators, in_flight=sampled)
            if settle:
                self._settled(logits)
            return result

    def idle_work(self, runner: ModelRunner) -> bool:
        """Every rank does one piece of its idle work together (ModelRunner.idle_work: a graph capture
        holds the all-reduces, which pair up across the ranks); returns whether work is left."""
        with self._as_step():
            self._check_alive()
            self._send(("idle",))
            left = runner.idle_work()
            if runner.device.type == "cuda":
                torch.cuda.current_stream(runner.device).synchronize()
            self._check_alive()
            return left

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        for rank, _, conn in self._ranks():
            try:
                conn.send_bytes(data)
            except OSError:
                raise self._find_failure(FAILURE_GRACE_S) or WorkerError(rank, "its pipe is closed") from None

    def settle(self, read: Callable[[], T]) -> T:
        """`read()` (the host's wait for a step launched with settle=False, e.g. its tokens' copy)
        as part of the step: an error in it, or a worker that died meanwhile, stops the workers and
        is raised as the step's would be (a WorkerError naming the failed rank)."""
        with self._as_step():
            value = read()
            self._settled(None)
            return value

    @contextlib.contextmanager
    def _as_step(self) -> Iterator[None]:
        """Run the body as part of a step: refused once closed; any error in it stops the workers and
        is raised as `abandon` says (the failed worker's WorkerError when a worker failed)."""
        if self.closed:
            raise RuntimeError(f"the tensor-parallel engine is closed{f' ({self.failure})' if self.failure else ''}")
        try:
            yield
        except BaseException as exc:
            error = self.abandon(exc)
            if error is exc:
                raise
            raise error from exc

    def _check_alive(self) -> None:
        """Raise the failure of a worker whose process has ended."""
        if wait([p.sentinel for p in self._state.processes], 0):
            raise self._find_failure(FAILURE_GRACE_S) or RuntimeError("a worker process ended")

    def _settled(self, logits: torch.Tensor | None) -> None:
        """Wait for the device (CUDA `logits`), then raise if a worker died meanwhile."""
        if logits is not None and logits.is_cuda:  # a failed collective surfaces here, not in the sampler
            torch.cuda.current_stream(logits.device).synchronize()
        self._check_alive()  # released, not finished, by on_death

    def _find_failure(self, grace: float, known: WorkerError | None = None) -> WorkerError | None:
        """The worker failure that explains the others: a worker's own error, or its death without a
        report, in preference to errors raised inside collectives (the echoes of a failure elsewhere);
        waits up to `grace` seconds for one. `known`: a failure already read from its pipe."""
        if known is not None and not known.in_collective:
            return known
        deadline = time.monotonic() + grace
        conns = {rank: conn for rank, _, conn in self._ranks()}  # pipes not at their end yet
        watched = {rank: process for rank, process, _ in self._ranks()}  # processes not seen dead yet
        echo, reported = known, {known.rank} if known is not None else set()
        while True:
            for rank, process in list(watched.items()):
                alive = process.is_alive()  # before reading: a dead worker's report is in the pipe by now
                while rank in conns:
                    try:
                        if not conns[rank].poll():
                            break
                        kind, payload = conns[rank].recv()
                    except (EOFError, OSError):
                        del conns[rank]
                        break
                    if kind == "error":
                        error = WorkerError.of(rank, payload)
                        if not error.in_collective:
                            return error
                        echo, reported = echo or error, reported | {rank}
                if not alive:
                    del watched[rank]
                    if rank not in reported:
                        return _died(rank, process)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return echo
            wait([*conns.values(), *(p.sentinel for p in watched.values())], remaining)

    def abandon(self, cause: BaseException) -> BaseException:
        """Stop every worker now, after an error on rank 0 while they may be mid-step or mid-load;
        returns the error to raise: the failed worker's WorkerError when a worker failed, else `cause`
        (a WorkerError already found, and rank 0's own errors about the artifact or the arguments,
        are raised as they are)."""
        error: BaseException = cause
        own = isinstance(cause, WorkerError | ValueError | ArtifactFormatError) or not isinstance(cause, Exception)
        if not own and not self.closed:  # e.g. gloo's error for a peer that went away: find which, and why
            error = self._find_failure(FAILURE_GRACE_S) or cause
        if self._finalizer.detach() is not None:
            _shutdown(self._state, graceful=False)
        self.failure = str(error).splitlines()[0] if str(error) else type(error).__name__
        return error

    def close(self) -> None:
        """Ask every worker to leave, wait for them (terminating stragglers), destroy the group. Idempotent."""
        self._finalizer()
