"""The server's log is one stream: every line on stderr (nothing on stdout), access lines included,
in one format — uvicorn's level prefix as text, or one JSON object a line with --log-format json
(the ready line carrying the URL, access lines their method, path and status)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from child_signals import sigint_as
from serve_harness import READY


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


def _serve_and_ask(art, log_format: str, prompt: str) -> tuple[str, list[str]]:
    """Start a server, send one completion, stop it (SIGTERM): its stdout and its stderr lines."""
    command = [sys.executable, "-m", "qruntime", "serve", str(art), "--port", "0", "--threads", "1"]
    proc = subprocess.Popen(
        [*command, "--log-format", log_format],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        preexec_fn=sigint_as(signal.SIG_DFL),
    )
    lines, ready, url = [], threading.Event(), []

    def read() -> None:
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if not url:
                found = json.loads(line).get("url") if log_format == "json" else (m := READY.match(line)) and m[1]
                if found:
                    url.append(found)
                    ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(120) and url, "\n".join(lines)
        response = httpx.post(f"{url[0]}/v1/completions", json={"prompt": prompt, "max_tokens": 3}, timeout=60)
        assert response.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        stdout = proc.stdout.read()
        assert proc.wait(120) == 0
        reader.join(10)
    return stdout, lines


def test_text_logs_are_one_stream_in_one_format(art, rng):
    stdout, lines = _serve_and_ask(art, "text", f"hello {rng.randrange(1000)}")
    assert stdout == ""  # access lines used to go to stdout
    assert all(line.startswith(("INFO:", "WARNING:", "ERROR:")) for line in lines), lines
    assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in lines), lines
    assert any(line.startswith("INFO:     loaded ") for line in lines)


def test_json_logs_are_one_object_a_line(art, rng):
    stdout, lines = _serve_and_ask(art, "json", f"hello {rng.randrange(1000)}")
    assert stdout == ""
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    access = [r for r in records if r["logger"] == "uvicorn.access"]
    assert any(r["method"] == "POST" and r["path"] == "/v1/completions" and r["status"] == 200 for r in access)
    ready = [r for r in records if r["message"].startswith("serving ")]
    assert len(ready) == 1 and ready[0]["url"].startswith("http://127.0.0.1:")
    assert any(r["message"].startswith("loaded ") for r in records)
    assert any(r["logger"].startswith("uvicorn") and "Shutting down" in r["message"] for r in records)
