"""Connections that cannot hold the server: uvicorn's HTTP protocol with a header timeout.

uvicorn closes an idle keep-alive connection after --timeout-keep-alive, but any byte received
cancels that timer, and nothing limits the wait for a request's headers: a client that connects and
sends nothing, or one header byte every few seconds (slowloris), keeps its connection forever. Here a
connection must deliver a request's complete headers within `header_timeout` seconds of connecting,
and of the end of its previous response; otherwise it is closed. The body's own time limit is the
app's (limits.read_json_body), and the number of connections is uvicorn's --limit-concurrency.

The protocol is uvicorn's httptools one (a C parser: the HTTP side of a stream costs several times
less than with h11, which at a hundred streamed clients is what the event loop spends its time on)
when httptools is installed (the `serve` extra installs it), else its h11 one; `protocol_class`
picks.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeaderTimeout:
    """The timer, mixed in before one of uvicorn's protocol classes (whose methods `super()` reaches);
    the subclass calls `_disarm_if_new_request()` where its protocol has parsed a request's headers."""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None
        self._waiting_after: object = None  # the cycle (request) before the headers being waited for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
            self._arm()  # keep-alive: the next request's headers are due in time too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        self._waiting_after = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _disarm_if_new_request(self) -> None:
        if self._header_timer is not None and self.cycle is not self._waiting_after:
            self._disarm()  # a new request's headers were parsed

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.cycle is self._waiting_after and not self.transport.is_closing():
            self.transport.close()


class HeaderTimeoutProtocol(_HeaderTimeout, H11Protocol):
    """H11Protocol that closes a connection whose request headers do not arrive in `header_timeout` s."""

    def handle_events(self) -> None:
        super().handle_events()
        self._disarm_if_new_request()


def _httptools_protocol() -> type | None:
    if importlib.util.find_spec("httptools") is None:
        return None
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsHeaderTimeoutProtocol(_HeaderTimeout, HttpToolsProtocol):
        """HttpToolsProtocol that closes a connection whose request headers do not arrive in time."""

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._disarm_if_new_request()

    return HttpToolsHeaderTimeoutProtocol


def protocol_class(prefer: str = "auto") -> type:
    """The header-timeout protocol to serve with: "httptools" (when installed, for "auto") or "h11"."""
    if prefer not in ("auto", "httptools", "h11"):
        raise ValueError(f"unknown HTTP protocol {prefer!r}: auto, httptools or h11")
    fast = _httptools_protocol() if prefer != "h11" else None
    if prefer == "httptools" and fast is None:
        raise ValueError("the httptools protocol needs the httptools package (pip install httptools)")
    return fast or HeaderTimeoutProtocol
