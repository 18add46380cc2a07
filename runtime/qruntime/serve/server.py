"""`qruntime serve ART`: load the artifact, build the app, run uvicorn until SIGINT / SIGTERM.

Shutdown (SIGINT / SIGTERM): uvicorn stops accepting connections and the engine loop new requests
(503); running requests get --shutdown-timeout seconds to finish, then the engine aborts what is
left, so those responses still end well-formed (a stream's last chunk says finish_reason "abort",
a whole response is a 503). uvicorn waits for the connections to close (cancelling any handler
still stuck SHUTDOWN_GRACE_S later, e.g. on a client that stopped reading), then the app's
lifespan stops the engine loop and its thread ends. A server started with SIGINT ignored (a shell
script's `cmd &`) keeps ignoring it; SIGTERM still stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import torch
import uvicorn
from uvicorn.server import HANDLED_SIGNALS

import qruntime
from qruntime.artifact import ArtifactFormatError
from qruntime.commands.common import RunError, load_line
from qruntime.engine.engine import Engine
from qruntime.serve.app import build_app
from qruntime.serve.connections import protocol_class
from qruntime.serve.engine_process import EngineProcess, EngineProcessError
from qruntime.serve.limits import RequestLimits
from qruntime.serve.logs import announce, log_config
from qruntime.serve.options import ServeOptions
from qruntime.serve.startup import Startup, start, url_of

SHUTDOWN_GRACE_S = 5.0  # after the aborts, how long uvicorn waits for responses to finish sending


class _Terminated(Exception):
    """SIGTERM after a graceful shutdown: a requested stop, so the command exits 0."""


def serve(options: ServeOptions, err: TextIO | None = None, startup: Startup | None = None) -> None:
    """Run the server until it is stopped (returns after a SIGTERM; SIGINT ends in KeyboardInterrupt,
    unless the process started with SIGINT ignored: then SIGINT is ignored). `startup`: what
    startup.start(options) began (its checks, the socket, the engine process spawned); started here
    when not given."""
    err = err if err is not None else sys.stderr
    startup = startup if startup is not None else start(options)
    try:
        if options.threads is not None:  # process-wide: the engine thread's ops use it too (and the engine
            torch.set_num_threads(options.threads)  # process's, which sets it itself)
        _serve_on(startup, options, err)
    finally:
        startup.sock.close()
        if startup.spawned is not None and not startup.taken:
            startup.spawned.kill()


def _serve_on(startup: Startup, options: ServeOptions, err: TextIO) -> None:
    sock, load_kwargs, started = startup.sock, startup.load_kwargs, startup.started
    engine: Engine | EngineProcess
    try:
        if startup.spawned is not None:
            startup.taken = True  # EngineProcess kills it if the load fails
            engine = EngineProcess(
                load_kwargs,
                max_waiting=options.max_waiting,
                threads=options.threads,
                log_config=log_config(options.log_format, options.log_level),
                pace_launches=options.launch_pacing,
                spawned=startup.spawned,
            )
        else:
            engine = qruntime.load(**load_kwargs)
    except (ArtifactFormatError, ValueError) as exc:
        raise RunError.of(exc) from None
    except EngineProcessError as exc:
        raise RunError(str(exc)) from None
    try:
        announce(load_line(engine.description, time.perf_counter() - started), options.log_format, err)
        limits = RequestLimits(max_body_bytes=options.max_body_bytes, body_timeout=options.body_timeout)
        app = build_app(
            engine,
            model_name=options.model_name,
            max_waiting=options.max_waiting,
            limits=limits,
            api_key=options.api_key,
            reasoning_parser=options.reasoning_parser,
            max_images=options.max_images_per_request,
            max_image_bytes=options.max_image_bytes,
            pace_launches=options.launch_pacing,
        )
    except BaseException:
        if isinstance(engine, EngineProcess):
            engine.stop()
        raise
    ready = (
        f"serving {options.model_name} on {url_of(sock)} (max_num_seqs {options.max_num_seqs}, "
        f"max_waiting {options.max_waiting}, max_model_len {engine.max_model_len}"
        f"{', API key required' if options.api_key else ''})"
    )
    loop = app.state.engine_loop
    config = uvicorn_config(app, options, configure_logging=True)

    def drain() -> None:
        loop.close()
        asyncio.get_running_loop().call_later(options.shutdown_timeout, loop.abort_all)

    url = url_of(sock)
    server = Server(config, on_ready=lambda: announce(ready, options.log_format, err, url=url), on_shutdown=drain)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        server.run(sockets=[sock])
    except _Terminated:
        pass
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        loop.stop()  # a no-op after the lifespan's; covers a forced exit (and ends the engine process)


def uvicorn_config(app: Any, options: ServeOptions, configure_logging: bool = False) -> uvicorn.Config:
    """uvicorn's settings for `app` under `options`: connections that must send their headers within
    --header-timeout (over httptools when installed, else h11), at most --limit-concurrency of them,
    the graceful shutdown's grace; uvloop's event loop when installed (uvicorn's "auto").
    configure_logging: this process's log as serve.logs says, --log-format and --log-level (the
    server's; tests embedding the app leave their process's logging alone)."""
    return uvicorn.Config(
        app,
        http=functools.partial(protocol_class(options.http), header_timeout=options.header_timeout),
        limit_concurrency=options.limit_concurrency,
        log_level=options.log_level,
        **({"log_config": log_config(options.log_format, options.log_level)} if configure_logging else {}),
        timeout_graceful_shutdown=options.shutdown_timeout + SHUTDOWN_GRACE_S,
        lifespan="on",
    )


def _on_sigterm(signum: int, frame: Any) -> None:
    # uvicorn swaps its own handler in while it runs and raises the signal again after its graceful
    # shutdown, which lands here
    raise _Terminated()


class Server(uvicorn.Server):
    """uvicorn's server, calling `on_ready()` once it listens and `on_shutdown()` as it begins to stop."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None], on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_ready, self._on_shutdown = on_ready, on_shutdown

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_ready()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, except that a signal ignored when the server starts stays ignored. uvicorn
        installs its handler for SIGINT regardless; but a process started with SIGINT ignored (a
        shell script's `cmd &`) is meant to keep ignoring it, as Python itself does (it installs no
        KeyboardInterrupt handler then). SIGTERM, which _serve_on handles before this runs, still
        stops the server gracefully."""
        if threading.current_thread() is not threading.main_thread():  # only the main thread can set handlers
            yield
            return
        handled = [sig for sig in HANDLED_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        # as uvicorn does: the signal that stopped the server, raised again to the handler it found
        # (SIGTERM lands in _on_sigterm; SIGINT is a KeyboardInterrupt)
        for sig in reversed(self._captured_signals):
            signal.raise_signal(sig)
