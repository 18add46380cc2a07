"""Start the engine process before the HTTP side imports its framework.

`qruntime serve` spends a few seconds importing torch, Starlette and uvicorn for its HTTP side, and
the engine process it spawns spends as long importing torch again before it loads the model. Spawned
first (this module imports nothing heavy, and the child's entry point imports the engine side only
when it runs), the two imports overlap and /health answers that much sooner. EngineProcess takes the
started process over (`spawned=`) or spawns one itself.
"""

from __future__ import annotations

import importlib
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

# the child's entry point, by name: imported there, never in the parent (engine_process.py imports this module)
ENTRY = ("qruntime.serve.engine_process", "engine_process_main")


@dataclass(frozen=True)
class Spawned:
    process: Any  # multiprocessing's spawn-context Process
    conn: Connection  # the HTTP side's end of the duplex pipe (protocol: engine_process.py)

    def kill(self) -> None:
        """For a server that fails before an EngineProcess takes this over."""
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join()


def spawn_engine(
    load_kwargs: dict[str, Any],
    threads: int | None = None,
    setup: Callable[[], None] | None = None,
    log_config: dict[str, Any] | None = None,
    pace_launches: bool = False,
) -> Spawned:
    """The engine process, started: it loads `load_kwargs` and then reports on the pipe."""
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe(duplex=True)
    # not a daemon: at tp > 1 the engine process spawns the other ranks itself
    process = context.Process(
        target=run_engine,
        args=(ENTRY, child, load_kwargs, threads, setup, log_config, pace_launches),
        name="qruntime-engine",
    )
    process.start()
    child.close()
    return Spawned(process, conn)


def run_engine(entry: tuple[str, str], conn: Connection, load_kwargs: dict[str, Any], *args: Any) -> None:
    """In the child: read the artifact's weights ahead (one pass, its thread then ends) while it
    imports the engine side, torch included (seconds), and start building its kernels as soon as
    torch is imported (qruntime.early_prebuild), then run it."""
    from qruntime.artifact import read_manifest_or_none
    from qruntime.read_ahead import ReadAhead

    manifest = read_manifest_or_none(load_kwargs["path"])  # once: the read-ahead, the early build, the load
    ReadAhead.of_artifact(load_kwargs["path"], manifest).start()
    from qruntime.early_prebuild import start_early  # imports torch

    early = start_early(load_kwargs["path"], (), load_kwargs, manifest)
    load_kwargs = {**load_kwargs, "manifest": manifest}
    if early is not None:
        load_kwargs["started_prebuild"] = early
    try:
        module, name = entry
        getattr(importlib.import_module(module), name)(conn, load_kwargs, *args)
    finally:
        if early is not None:  # a load that failed before taking it over
            early.cancel()
