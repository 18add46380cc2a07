"""Responses that end when the client goes away: Server-Sent Events, and any awaited work.

Both race the work against the ASGI `receive` channel's http.disconnect, whatever ASGI spec version
the server speaks, so a vanished client cancels its work (and with it, its engine sequences) at once.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


async def until_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `work()` unless the client disconnects first: (finished, its result). Call after the
    request body has been read (nothing else may be reading `receive`)."""
    outcome: dict[str, Any] = {}
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            outcome["result"] = await work()
        except Exception as exc:  # raised below, outside the task group (no ExceptionGroup wrapping)
            outcome["error"] = exc
        group.cancel_scope.cancel()
    if "error" in outcome:
        raise outcome["error"]
    return "result" in outcome, outcome.get("result")


class SSEResponse(Response):
    """`text/event-stream` from an async generator of ready-made events ("data: ...\\n\\n").

    However the response ends (done, client gone, the server cancelling the request) the generator
    is closed and `on_close()` called, even when the generator never started."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            try:
                async for event in self.events:
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # ASGI 2.4 servers raise on sending to a gone client
                pass

        try:
            await until_disconnected(receive, stream)
        finally:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()
            self.on_close()


def sse_event(data: str) -> str:
    return f"data: {data}\n\n"
