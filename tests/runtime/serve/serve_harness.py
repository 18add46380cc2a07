"""What the serve tests share: `qruntime serve` in a subprocess on a free loopback port, its
/metrics as numbers, bench/loadgen.py (the load test's client) imported from the repo, and the
small CPU engine and prompts the in-process servers use."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
from child_signals import sigint_as
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[3]
READY = re.compile(r"^(?:INFO: +)?serving .+ on (http://\S+) ")
CPU_LOAD = {"device": "cpu", "max_model_len": 256, "num_kv_blocks": 64}  # qruntime.load's kwargs for a small CPU engine
WORDS = ("the", "model", "runs", "fast", "hello", "world", "cache", "tokens")


def random_text(rng: random.Random) -> str:
    """A prompt of 2 to 6 of WORDS."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 7)))


def load_loadgen() -> ModuleType:
    """bench/loadgen.py as the module `loadgen` (bench/ is scripts, not a package)."""
    if "loadgen" not in sys.modules:
        spec = importlib.util.spec_from_file_location("loadgen", ROOT / "bench" / "loadgen.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["loadgen"] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules["loadgen"]


class ServerProcess:
    """`python -m qruntime serve ART --port 0 ...` (or `-m qcompile serve`); `url` once it listens. Use as a context manager:
    leaving it stops the server (SIGTERM), killing it only if it does not exit in time. It starts with
    SIGINT's disposition `sigint`: SIG_DFL unless told, whatever pytest's own is (see child_signals)."""

    def __init__(
        self, artifact: Path, *args: str, cli: str = "qruntime", sigint: signal.Handlers = signal.SIG_DFL
    ) -> None:
        self.command = [
            sys.executable,
            "-m",
            cli,  # qruntime, or qcompile (whose `serve` is the same server)
            "serve",
            str(artifact),
            "--port",
            "0",
            "--log-level",
            "warning",
            *args,
        ]
        self.lines: list[str] = []  # its stderr, line by line
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()
        self.signaled = False
        self.sigint = sigint

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    def start(self, timeout: float = 120.0) -> ServerProcess:
        env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
        self.proc = subprocess.Popen(
            self.command,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
            preexec_fn=sigint_as(self.sigint),
        )
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._ready.wait(timeout) or self.url is None:
            self.kill()
            raise RuntimeError(f"the server did not start in {timeout} s:\n{self.stderr}")
        return self

    def _drain(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.lines.append(line)
            if self.url is None and (match := READY.match(line)):
                self.url = match[1]
                self._ready.set()
        self._ready.set()  # exited before it was ready

    def send(self, sig: int = signal.SIGTERM) -> None:
        self.signaled = True
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        """Send `sig` (unless a signal was sent already: a second one would cut the graceful
        shutdown short) and wait for the exit code."""
        if self.proc.poll() is None and not self.signaled:
            self.send(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # by our Popen's pid
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.stop()


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's op threads set to `count` for the block (the server runs with --threads count: the
    same reductions, and no oversubscribed cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class ThreadedServer:
    """An ASGI app on uvicorn in a thread of this process, on a free loopback port; `url` while in
    the `with` block, which ends with uvicorn's own shutdown (lifespan included)."""

    def __init__(self, app: object, config: object | None = None) -> None:
        """`config`: a uvicorn.Config of `app` (e.g. the server's own, qruntime.serve.server.uvicorn_config)."""
        import uvicorn

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(config or uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


def metrics(url: str) -> dict[str, float]:
    """/metrics as {sample name (with {labels} when it has some): value}."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds KV blocks (or the last reading at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (
            m["qruntime_num_requests_running"] == 0
            and m["qruntime_num_requests_waiting"] == 0
            and m["qruntime_kv_cache_blocks_used"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)
