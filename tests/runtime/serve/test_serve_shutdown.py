"""Graceful shutdown: on SIGTERM the server stops accepting, lets in-flight requests finish, and
exits 0; past --shutdown-timeout it aborts what still runs, in well-formed responses (a stream's
last chunk says finish_reason "abort", a whole response is a 503), and exits 0 all the same.
SIGINT exits 130, as `qruntime run` does; a server started with SIGINT ignored (as a shell
script's `cmd &` is) keeps ignoring it, as Python itself does, and stops on SIGTERM."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
import qruntime
from qruntime import SamplingParams
from serve_harness import ServerProcess, load_loadgen, torch_threads


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


def _specs(loadgen, count: int, max_tokens: int) -> list:
    specs = []
    for i in range(count):
        body = {
            "prompt": [random.randrange(500) for _ in range(random.randrange(3, 10))],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": i % 2 == 0,
            "return_token_ids": True,
        }
        specs.append(loadgen.RequestSpec(loadgen.COMPLETIONS, body))
    return specs


async def _stop_while_running(server: ServerProcess, specs: list, sig: int = signal.SIGTERM) -> tuple[list, bool]:
    """Send specs, signal the server once every request runs, and collect the results; also whether
    a new connection was refused after the signal while they still ran."""
    loadgen = load_loadgen()
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        tasks = [asyncio.create_task(loadgen.send(client, spec)) for spec in specs]
        deadline = time.monotonic() + 60
        while True:
            await asyncio.sleep(0.02)
            running = await client.get("/metrics")
            count = next(
                float(line.split()[-1])
                for line in running.text.splitlines()
                if line.startswith("qruntime_num_requests_running ")
            )
            if count == len(specs) or time.monotonic() > deadline:
                break
        assert count == len(specs), f"only {count} of {len(specs)} requests started"
        server.send(sig)
        refused = False  # a new connection is refused while the accepted requests still run
        no_reuse = httpx.Limits(max_keepalive_connections=0)  # every try opens a new connection
        async with httpx.AsyncClient(base_url=server.url, timeout=5, limits=no_reuse) as fresh:
            while not refused and not all(t.done() for t in tasks):
                try:
                    await fresh.get("/health")
                except httpx.ConnectError:
                    refused = not all(t.done() for t in tasks)
                except (httpx.ReadError, httpx.RemoteProtocolError):
                    pass  # accepted just before the listener closed, then closed by the shutdown
                await asyncio.sleep(0.05)
        return await asyncio.gather(*tasks), refused


def test_sigterm_lets_in_flight_requests_finish(art):
    loadgen = load_loadgen()
    specs = _specs(loadgen, 4, max_tokens=200)
    server = ServerProcess(art, "--shutdown-timeout", "60", "--threads", "1").start()
    try:
        results, refused = asyncio.run(_stop_while_running(server, specs))
        code = server.stop(timeout=60)
    finally:
        server.kill()
    assert refused  # the listening socket closed at once
    engine = qruntime.load(art, "cpu")
    with torch_threads(1):
        for r in results:
            assert r.status == 200 and r.error is None and (r.done or not r.spec.stream), r
            (expected,) = engine.generate(r.spec.body["prompt"], SamplingParams(max_tokens=200, ignore_eos=True))
            choice = r.choices()[0]
            assert choice["token_ids"] == list(expected.token_ids) and choice["finish_reason"] == "length"
    assert code == 0, server.stderr
    assert "Traceback" not in server.stderr and "aborting" not in server.stderr


def test_past_the_shutdown_timeout_running_requests_are_cancelled(art):
    loadgen = load_loadgen()
    specs = _specs(loadgen, 3, max_tokens=3500)  # far longer than the timeout on a CPU
    server = ServerProcess(art, "--shutdown-timeout", "1", "--max-model-len", "4096").start()
    try:
        started = time.monotonic()
        results, refused = asyncio.run(_stop_while_running(server, specs))
        code = server.stop(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        server.kill()
    assert refused
    for r in results:  # aborted, and told so in a well-formed response
        assert r.error is None, r
        if r.spec.stream:
            assert r.status == 200 and r.done and r.chunks[-1]["choices"][0]["finish_reason"] == "abort", r
            assert 0 < len(r.choices()[0]["token_ids"]) < 3500
        else:
            assert r.status == 503 and r.body["error"]["code"] == "aborted", r
            assert "shutting down" in r.body["error"]["message"]
    assert code == 0 and elapsed < 30, server.stderr
    assert f"aborting {len(specs)} unfinished sequence(s)" in server.stderr
    assert "Traceback" not in server.stderr and "timeout graceful shutdown exceeded" not in server.stderr


def test_sigint_exits_130_after_shutting_down(art):
    server = ServerProcess(art).start()
    try:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        code = server.stop(signal.SIGINT, timeout=60)
    finally:
        server.kill()
    assert code == 130, server.stderr
    assert "interrupted" in server.stderr and "Traceback" not in server.stderr


def _ignores_sigint(pid: int) -> bool:
    """Whether process `pid` ignores SIGINT (the kernel drops it), from Linux's /proc/PID/status."""
    ignored = re.search(r"^SigIgn:\s*([0-9a-f]+)$", Path(f"/proc/{pid}/status").read_text(), re.M)
    return bool(int(ignored[1], 16) >> (signal.SIGINT - 1) & 1)


def test_sigint_ignored_at_start_stays_ignored(art):
    """Started with SIGINT ignored, the server installs no SIGINT handler (uvicorn's would stop it):
    it answers after a SIGINT, and SIGTERM still shuts it down gracefully, exit 0."""
    server = ServerProcess(art, sigint=signal.SIG_IGN).start()
    try:
        assert _ignores_sigint(server.proc.pid)  # while serving, i.e. with uvicorn's handlers in place
        server.proc.send_signal(signal.SIGINT)  # not server.send, after which stop() sends no SIGTERM
        deadline = time.monotonic() + 2  # uvicorn looks for a requested exit every 0.1 s
        while time.monotonic() < deadline:
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            time.sleep(0.1)
        assert server.proc.poll() is None, server.stderr
        code = server.stop(signal.SIGTERM, timeout=60)
    finally:
        server.kill()
    assert code == 0, server.stderr
    assert "interrupted" not in server.stderr and "Traceback" not in server.stderr
