"""What `qruntime serve` does before it imports its HTTP framework: check the options, bind the
port, and spawn the engine process, so the engine's load overlaps the HTTP side's imports
(engine_spawn.py). Imports nothing heavy: no torch, no Starlette, no uvicorn."""

from __future__ import annotations

import logging.config
import socket
import time
from dataclasses import dataclass
from typing import Any

from qruntime.commands.common import RunError, speculative_config
from qruntime.serve.engine_spawn import Spawned, spawn_engine
from qruntime.serve.logs import log_config
from qruntime.serve.options import ServeOptions


@dataclass
class Startup:
    sock: socket.socket  # bound and listening: a port in use is an error before any load
    load_kwargs: dict[str, Any]  # qruntime.load's
    started: float  # perf_counter at the start, for the load line
    spawned: Spawned | None  # the engine process (--engine process), loading
    taken: bool = False  # an EngineProcess owns `spawned` (it kills it on failure)


def listen(host: str, port: int) -> socket.socket:
    """A bound listening socket (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise RunError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def start(options: ServeOptions) -> Startup:
    """Check the options (a RunError naming the flag), bind the port, spawn the engine process."""
    if options.max_waiting < 1:
        raise RunError(f"--max-waiting must be >= 1 (got {options.max_waiting})")
    if options.shutdown_timeout < 0:
        raise RunError(f"--shutdown-timeout must be >= 0 (got {options.shutdown_timeout})")
    for flag, value in (
        ("--max-body-bytes", options.max_body_bytes),
        ("--header-timeout", options.header_timeout),
        ("--body-timeout", options.body_timeout),
        ("--limit-concurrency", options.limit_concurrency),
        ("--max-images-per-request", options.max_images_per_request),
        ("--max-image-bytes", options.max_image_bytes),
    ):
        if not value > 0:
            raise RunError(f"{flag} must be > 0 (got {value})")
    speculative = speculative_config(options.speculative)  # a bad SPEC before the port and the load
    if options.api_key is not None and not options.api_key.strip():
        raise RunError("--api-key is empty: give a key, or leave the option (and QRUNTIME_API_KEY) unset")
    if options.threads is not None and options.threads < 1:
        raise RunError(f"--threads must be >= 1 (got {options.threads})")
    started = time.perf_counter()
    load_kwargs = {
        "path": options.artifact,
        "device": options.device,
        "dtype": options.dtype,
        "verify": options.verify,
        "max_model_len": options.max_model_len,
        "max_num_seqs": options.max_num_seqs,
        "max_num_batched_tokens": options.max_num_batched_tokens,
        "num_kv_blocks": options.num_kv_blocks,
        "backend": options.backend,
        "prefix_cache": options.prefix_cache,
        "graph_capture": options.graph_capture,
        "speculative": speculative,
    }
    # the port first: one in use is an error now, not after a model's minutes of loading
    sock = listen(options.host, options.port)
    spawned = None
    if options.engine == "process":
        try:
            spawned = spawn_engine(
                load_kwargs,
                options.threads,
                log_config=log_config(options.log_format, options.log_level),
                pace_launches=options.launch_pacing,
            )
        except BaseException:
            sock.close()
            raise
    # after the spawn: the config names uvicorn's formatters, which imports it (the engine process
    # configures its own log from the same dict)
    logging.config.dictConfig(log_config(options.log_format, options.log_level))  # the load's lines too
    return Startup(sock, load_kwargs, started, spawned)
