"""What runs in a spawned tensor-parallel worker: build one rank, then run the steps rank 0 sends.

Messages, over the worker's pipe to rank 0 (engine/workers.py has rank 0's side):
  worker -> rank 0: `(tag, None)` at each build checkpoint ("loaded", "planned", "kernels", "ready");
                    `("error", Report)` when it raises, then it exits.
  rank 0 -> worker: `("step", chunks, all_logits, sampling, shared, rows)` (StepChunk tuples,
                    pickled once by rank 0 for every worker; sampling: ShardedSampling or None, for
                    a rank that holds a vocabulary shard; shared: how many token ids rank 0 sends
                    after sampling gathered rows alone, else None; rows: the step's Qwen3-VL image
                    rows, whose embeddings the chunks leave out and rank 0 broadcasts next
                    (engine/vision_share.py), 0 for none), `("close",)`; end of file means rank 0
                    is gone. A chunk's pending id (step_chunk.pending: async scheduling) names a row
                    of the tokens of this rank's step before: sampled with the others from the
                    shards, or shared by rank 0; rank 0 sends one only after such a step.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from qruntime.engine.model_runner import ModelRunner
from qruntime.engine.sharded_sampler import finish_step, share_tokens
from qruntime.engine.vision_share import receive_embeds
from qruntime.rank import GROUP_TIMEOUT, RankConfig, build_rank

MAX_REPORT = 16384  # characters of a traceback sent: a small pipe write never blocks a dying worker
DISTRIBUTED_DIR = str(Path(dist.__file__).parent)


class Report(NamedTuple):
    """A worker's exception: its last line, its traceback, and whether it was raised inside a
    torch.distributed call (then most likely the echo of another rank's failure, not the cause)."""

    summary: str
    traceback: str
    in_collective: bool


def report(exc: BaseException) -> Report:
    frames = traceback.extract_tb(exc.__traceback__)
    return Report(
        "".join(traceback.format_exception_only(exc)).strip()[-MAX_REPORT:],
        "".join(traceback.format_exception(exc))[-MAX_REPORT:],
        any(frame.filename.startswith(DISTRIBUTED_DIR) for frame in frames),
    )


def _serve(conn: Connection, runner: ModelRunner) -> None:
    last = None  # the token ids of this rank's last sampled step: what a next step's pending ids name
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if message[0] == "close":
            return
        if message[0] == "idle":  # rank 0's idle work, which every rank does at the same point
            runner.idle_work()
            continue
        _, chunks, all_logits, sampling, shared, rows = message
        if rows:  # the image rows' embeddings, from rank 0's broadcast (it runs the vision encoder)
            if runner.vision is None:
                raise ValueError(f"rank 0 sent a step with {rows} image rows, but this rank's graph takes no images")
            chunks = receive_embeds(chunks, rows, *runner.vision, runner.device)
        sampled = None
        if any(c.token_ids[-1] < 0 for c in chunks):  # async scheduling: tokens sampled by the step before
            if last is None:
                raise ValueError("rank 0 sent pending token ids, but this rank's step before sampled none")
            sampled = last
        logits = runner.execute(chunks, all_logits, sampled=sampled)
        # rank 0 keeps the result: the tokens (sharded sampling: every rank holds them, and keeps them
        # for the next step), else the logits, which it gathers from the vocabulary shards or already
        # has (a replicated head computes them on every rank)
        result = finish_step(runner.vocab_shard, logits, sampling, in_flight=last)
        if shared:  # rank 0 sampled the gathered rows alone and sends this rank its tokens
            last = share_tokens(runner.vocab_shard, None, shared, logits.device)
        elif all_logits is not True:  # a scoring pass (Engine.score) samples nothing and leaves the step before's
            last = result[0] if sampling is not None else None


def share_cores(tp: int) -> int:
    """The torch threads of each rank on CPU: the cores split between the tp processes. Rank 0
    takes the workers' share too: with its default (every core) its idle OpenMP threads spin on the
    cores the workers' steps need, which made tp = 2 steps several times slower on 2 cores."""
    return max(1, (os.cpu_count() or 1) // tp)


def worker_main(rank: int, config: RankConfig, port: int, conn: Connection) -> None:
    """The target of worker `rank`'s process: rendezvous at rank 0's store on `port`, build, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops the workers
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: a stuck worker's stacks on stderr
    try:
        device = config.device_of(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # share the cores between the ranks instead of each taking them all
            torch.set_num_threads(share_cores(config.tp))
        store = dist.TCPStore("127.0.0.1", port, config.tp, is_master=False, timeout=GROUP_TIMEOUT)
        built = build_rank(config, rank, store, lambda tag: conn.send((tag, None)))
        _serve(conn, built.runner)
        if device.type == "cuda":  # NCCL's destroy waits for every rank: leave without it (rank 0 aborts its own)
            os._exit(0)
        dist.destroy_process_group()
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", report(exc)))
        os._exit(1)  # no interpreter teardown: a broken process group or CUDA context may hang in it
