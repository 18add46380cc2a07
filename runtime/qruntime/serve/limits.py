"""What one request may ask of the server, checked before any tokenizing or parsing work.

The guard runs first on every route: the API key (/v1/* routes, when the server has one), then, on a
POST, the Content-Type (application/json only: a web page can send a form or text/plain POST to a
localhost server without CORS asking anyone, but not JSON), then the body, read against its byte cap
(413 as soon as Content-Length or the bytes received pass it) and its time limit (408), then parsed
with bounded nesting. The per-field caps (n, stop strings, stop token ids) are checked by protocol.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request

from qruntime.bounded_json import JSONLimitError, loads
from qruntime.serve.errors import APIError, invalid
from qruntime.shown import shown

JSON_TYPES = ("application/json",)


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request (the serve CLI sets the first two)."""

    max_body_bytes: int = 4 << 20  # --max-body-bytes
    body_timeout: float = 30.0  # --body-timeout: seconds from the headers to the whole body
    max_json_depth: int = 32  # nesting of arrays / objects in the body (a chat request needs about 6)
    max_n: int = 128  # choices per prompt, as OpenAI's n
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 4096  # their total length, in characters
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 300  # OpenAI's cap on logit_bias entries
    max_tools: int = 128  # OpenAI's cap on tools per request

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_json_depth",
            "max_n",
            "max_stop",
            "max_stop_chars",
            "max_stop_token_ids",
            "max_logit_bias",
            "max_tools",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if not self.body_timeout > 0:
            raise ValueError(f"body_timeout must be > 0 (got {self.body_timeout})")


def check_api_key(request: Request, api_key: str | None) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>` (compared in constant time)."""
    if api_key is None or not request.url.path.startswith("/v1/"):
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())):
        raise APIError(
            401,
            "Missing or wrong API key: send the header `Authorization: Bearer <key>` with the server's --api-key.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def check_content_type(request: Request) -> None:
    """415 for a body that does not say it is JSON (parameters such as charset=utf-8 are fine)."""
    given = request.headers.get("content-type", "")
    media_type = given.partition(";")[0].strip().lower()
    if media_type not in JSON_TYPES:
        raise APIError(
            415,
            f"Content-Type must be application/json (got {shown(given)}); send the body as JSON with that header.",
            code="unsupported_media_type",
        )


async def read_json_body(request: Request, limits: RequestLimits) -> Any:
    """The request's JSON body, within `limits` (413, 408, or 400 naming the problem)."""
    cap = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise invalid(None, "the Content-Length header is not a byte count", "invalid_header")
        if int(declared) > cap:
            raise _too_large(cap, f"Content-Length says {declared} bytes")
    chunks, size = [], 0
    try:
        with anyio.fail_after(limits.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise _too_large(cap, f"more than {cap} bytes arrived")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {limits.body_timeout:g} s", code="request_timeout"
        ) from None
    except ClientDisconnect:
        raise APIError(499, "the client disconnected while sending the request") from None
    try:
        return loads(b"".join(chunks), what="the request body", max_depth=limits.max_json_depth)
    except JSONLimitError as exc:
        raise invalid(None, str(exc), "invalid_json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(None, f"the request body is not valid JSON: {exc}", "invalid_json") from None


def _too_large(cap: int, what: str) -> APIError:
    return APIError(
        413, f"the request body is too large: {what}, and this server accepts at most {cap} (--max-body-bytes)",
        code="request_too_large",
    )  # fmt: skip
