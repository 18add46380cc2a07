"""`qruntime serve ART`: an OpenAI-compatible HTTP server over one Engine (the `serve` extra).

The layout is the request's path: `connections` (uvicorn's protocol with a header timeout) hands
it to `app` (Starlette routes), which checks it against `limits` (API key, Content-Type, body size
and time, bounded JSON) and parses the body with `protocol` into engine sequences, hands them to `engine_client` (a Handle
per request, read from an asyncio queue) over `engine_process` (the engine loaded in a process of
its own) or on a thread here, where `engine_loop` (the one thread that owns the Engine and steps
it, batching every client's sequences together) runs; answers go out as `responses` shapes, through
`sse`; `errors` is OpenAI's error JSON, `metrics` the Prometheus side, `server` runs uvicorn with
the CLI's `options`. Importing this package or `options` is cheap: the framework (starlette,
uvicorn, prometheus-client) and torch load when `main` starts a server.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qruntime.serve.options import ServeOptions

EXTRA_MODULES = ("starlette", "uvicorn", "prometheus_client")


def main(options: ServeOptions) -> None:
    """Check the `serve` extra is installed (a RunError naming the install command if not), then serve."""
    from qruntime.commands.common import RunError
    from qruntime.serve.startup import start

    for name in EXTRA_MODULES:  # found, not imported: the engine process starts before they load
        if importlib.util.find_spec(name) is None:
            raise RunError(
                f"`qruntime serve` needs the serve extra: pip install 'qcompile-runtime[serve]' (no module {name!r})"
            )
    startup = start(options)  # the engine process loads while the HTTP side imports below
    try:
        from qruntime.serve.server import serve
    except BaseException:
        startup.sock.close()
        if startup.spawned is not None:
            startup.spawned.kill()
        raise
    serve(options, startup=startup)
