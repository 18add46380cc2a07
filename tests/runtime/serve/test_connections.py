"""The header timeout on both of uvicorn's HTTP protocols (httptools, h11): a connection that sends
no headers, or stops halfway (slowloris), is closed once `header_timeout` has passed; a keep-alive
connection gets the same time for its next request's headers; requests in time are served."""

from __future__ import annotations

import socket
import time

import pytest
from qruntime.serve.connections import HeaderTimeoutProtocol, protocol_class
from qruntime.serve.options import ServeOptions
from qruntime.serve.server import uvicorn_config
from serve_harness import ThreadedServer
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

TIMEOUT = 0.6


def _app() -> Starlette:
    return Starlette(routes=[Route("/ok", lambda request: PlainTextResponse("ok"))])


def _request(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while not data.endswith(b"ok"):
        chunk = sock.recv(4096)
        assert chunk, "closed before the response"
        data += chunk
    return data


def _closed(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_late_headers_close_the_connection_and_timely_ones_are_served(http):
    chosen = protocol_class(http)
    assert (chosen is HeaderTimeoutProtocol) == (http == "h11")
    options = ServeOptions("unused", log_level="warning", header_timeout=TIMEOUT, http=http)
    app = _app()
    with ThreadedServer(app, uvicorn_config(app, options)) as server:
        silent = socket.create_connection(("127.0.0.1", server.port))
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        kept = socket.create_connection(("127.0.0.1", server.port))
        started = time.monotonic()
        assert b"200 OK" in _request(kept)
        assert not _closed(kept, TIMEOUT / 3)  # kept alive after its response
        assert b"200 OK" in _request(kept)  # its next request, in time, is served
        for sock in (silent, slow, kept):
            assert _closed(sock, 5 * TIMEOUT), "a connection without headers outlived the timeout"
        assert time.monotonic() - started < 5 * TIMEOUT
        fresh = socket.create_connection(("127.0.0.1", server.port))
        assert b"200 OK" in _request(fresh)
        for sock in (silent, slow, kept, fresh):
            sock.close()


def test_an_unknown_protocol_is_refused():
    with pytest.raises(ValueError, match="unknown HTTP protocol"):
        protocol_class("h2")
