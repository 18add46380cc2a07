"""The ASGI app (Starlette): OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus
/health and /metrics. Handlers parse and check a request (protocol), submit its sequences to the
engine loop, and answer from the deltas that come back, streamed (SSE) or whole. A Qwen3-VL model's
chat requests may carry images (serve/images.py), decoded and preprocessed on a worker thread.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from qruntime.engine.engine import Engine
from qruntime.engine.outputs import RequestOutput
from qruntime.serve.engine_client import EngineClient, FailedRequest, Handle, InThreadEngine
from qruntime.serve.engine_loop import QueueFull, ShuttingDown
from qruntime.serve.engine_process import EngineProcess
from qruntime.serve.errors import APIError, error_body
from qruntime.serve.images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGES, ServedVision, has_image_parts
from qruntime.serve.limits import RequestLimits, check_api_key, check_content_type, read_json_body
from qruntime.serve.metrics import CONTENT_TYPE, Metrics
from qruntime.serve.protocol import REASONING_PARSERS, GenerationRequest, ServedModel, parse_chat, parse_completion
from qruntime.serve.responses import ResponseBuilder
from qruntime.serve.sse import SSEResponse, sse_event, until_disconnected

RETRY_AFTER_S = 1  # the Retry-After of a 429: a step or a few frees room in the queue

logger = logging.getLogger(__name__)


INLINE_PARSE_CHARS = 8192  # text a request may carry (to render and tokenize) and still be parsed on the event loop


def _dumps(body: Any) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def _text_chars(body: Any, limit: int) -> int:
    """Characters of text in a parsed JSON body, counted up to just past `limit` (lists of numbers,
    e.g. token ids, are skipped whole: they are not tokenized)."""
    total, stack = 0, [body]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(map(len, item))
            stack.extend(item.values())
        elif isinstance(item, list) and not {int, float}.issuperset(map(type, item)):
            stack.extend(item)
    return total


class OpenAIRoutes:
    """The handlers of one served model."""

    def __init__(self, model: ServedModel, loop: EngineClient, metrics: Metrics, limits: RequestLimits) -> None:
        self.model, self.loop, self.metrics, self.limits = model, loop, metrics, limits

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion, "cmpl")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, parse_chat, "chatcmpl")

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model.name,
            "object": "model",
            "created": self.model.created,
            "owned_by": "qruntime",
            "root": self.model.name,
            "max_model_len": self.model.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        if not self.loop.alive:
            raise APIError(503, "the engine is not running", code="engine_dead")
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # --- generation ---------------------------------------------------------------------------------
    async def _generate(
        self, request: Request, parse: Callable[[Any, ServedModel], GenerationRequest], prefix: str
    ) -> Response:
        check_content_type(request)
        body = await read_json_body(request, self.limits)
        # tokenizing (and rendering a chat template) off the event loop keeps other streams flowing; a
        # request with little text is parsed in place: the hand-over to a worker thread and back cost
        # more than its parse (a burst of 32 prompts of 2,064 token ids reached the engine over ~100 ms)
        # (images are decoded and preprocessed there too, however small)
        inline = _text_chars(body, INLINE_PARSE_CHARS) <= INLINE_PARSE_CHARS
        if inline and not (self.model.vision is not None and has_image_parts(body)):
            parsed = parse(body, self.model)
        else:
            parsed = await anyio.to_thread.run_sync(parse, body, self.model)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            handle = self.loop.submit(request_id, parsed.sequences)
        except QueueFull as exc:
            raise APIError(
                429, f"Too many requests: {exc}", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}
            ) from None
        except ShuttingDown as exc:
            raise APIError(503, str(exc), code="unavailable") from None
        if parsed.images:
            self.metrics.on_images(parsed.images)
        builder = ResponseBuilder(parsed, request_id, self.model.name, int(time.time()), self.model.tokenizer)
        if parsed.stream:
            return SSEResponse(self._events(handle, builder), on_close=handle.close)
        return await self._whole(request, handle, builder)

    async def _events(self, handle: Handle, builder: ResponseBuilder) -> AsyncGenerator[str, None]:
        try:
            for chunk in builder.role_chunks():
                yield sse_event(_dumps(chunk))
            completion_tokens = 0
            while not handle.done:
                events = []
                for index, delta in await handle.get_merged():  # all that is queued: one send
                    completion_tokens += len(delta.token_ids)
                    chunk = builder.chunk(index, delta)
                    if chunk is not None:
                        events.append(sse_event(_dumps(chunk)))
                if events:
                    yield "".join(events)
            if builder.request.include_usage:
                yield sse_event(_dumps(builder.usage_chunk(completion_tokens)))
        except FailedRequest as exc:
            f = exc.failure
            yield sse_event(_dumps(error_body(f.status, f.message)))
        finally:
            handle.close()  # aborts what is unfinished when the client left or the server cancelled us
        yield sse_event("[DONE]")

    async def _whole(self, request: Request, handle: Handle, builder: ResponseBuilder) -> Response:
        async def collect() -> dict[int, RequestOutput]:
            outputs = {}
            while not handle.done:
                for index, delta in await handle.get_merged():
                    if delta.finished:
                        outputs[index] = delta.output
            return outputs

        try:
            finished, outputs = await until_disconnected(request.receive, collect)
        except FailedRequest as exc:
            raise APIError(exc.failure.status, exc.failure.message) from None
        finally:
            handle.close()
        if not finished:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if any(o.finish_reason == "abort" for o in outputs.values()):  # only the server aborts a listened-to request
            raise APIError(
                503, "the server is shutting down: the request was aborted before it finished", code="aborted"
            )
        return JSONResponse(builder.full(outputs))


def build_app(
    engine: Engine | EngineProcess,
    *,
    model_name: str,
    max_waiting: int = 256,
    stop_timeout: float = 60.0,
    limits: RequestLimits | None = None,
    api_key: str | None = None,
    reasoning_parser: str | None = None,
    max_images: int = DEFAULT_MAX_IMAGES,
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    pace_launches: bool = False,
) -> Starlette:
    """The server's ASGI app over `engine`: an Engine of this process (stepped on a thread of it) or
    an EngineProcess (whose own max_waiting holds). Its lifespan starts the engine loop and stops it
    (aborting whatever is still running) at shutdown; `app.state.engine_loop` / `app.state.metrics`
    are there for tests. With `api_key`, every /v1/* route wants `Authorization: Bearer <api_key>`
    (401 otherwise). With `reasoning_parser` ("qwen3"), chat replies return their thinking apart,
    as `reasoning_content` (qruntime.reasoning). A Qwen3-VL engine (its `vision` set) takes chat image
    parts, at most `max_images` per request of at most `max_image_bytes` each (serve/images.py); a
    text model refuses them. `pace_launches`: an in-process engine loop's launch pacing (EngineLoop; an
    EngineProcess was given its own)."""
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty: give a key, or None for none")
    limits = limits if limits is not None else RequestLimits()
    vision = ServedVision.of(getattr(engine, "vision", None))
    if vision is not None:  # ValueError for a limit below 1
        vision = vision.for_clients(max_images, max_image_bytes)
    loop: EngineClient
    if isinstance(engine, EngineProcess):
        loop, max_waiting = engine, engine.max_waiting
    else:
        loop = InThreadEngine(engine, max_waiting=max_waiting, pace_launches=pace_launches)
    metrics = Metrics(loop.stats, lambda: loop.prefix_cache_stats, lambda: loop.speculative_stats)
    loop.metrics = metrics
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} (got {reasoning_parser!r})")
    model = ServedModel(
        model_name,
        engine.tokenizer,
        engine.vocab_size,
        engine.max_model_len,
        int(time.time()),
        max_waiting,
        limits,
        reasoning_parser,
        vision,
    )
    routes = OpenAIRoutes(model, loop, metrics, limits)

    def internal_error(request: Request, exc: Exception) -> Response:
        # the cause goes to the log under an id the client sees; its text may hold anything
        error_id = f"err-{uuid.uuid4().hex[:16]}"
        logger.error("%s %s failed (%s)", request.method, request.url.path, error_id, exc_info=exc)
        metrics.on_rejected(500)
        message = f"internal server error ({error_id}); the server log has the details under that id"
        return JSONResponse(error_body(500, message), 500)

    def guarded(endpoint: Callable[[Request], Any]) -> Callable[[Request], Any]:
        """The endpoint behind the API key check, its unexpected exceptions answered as a 500 here
        (Starlette's last-resort handler would re-raise them to uvicorn, which then drops the connection)."""

        async def handle(request: Request) -> Response:
            check_api_key(request, api_key)
            try:
                return await endpoint(request)
            except (APIError, HTTPException):
                raise
            except Exception as exc:
                return internal_error(request, exc)

        return handle

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncGenerator[None, None]:
        loop.start()
        try:
            yield
        finally:
            loop.stop(stop_timeout)

    async def api_error(request: Request, exc: APIError) -> Response:
        metrics.on_rejected(exc.status)
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        metrics.on_rejected(exc.status_code)
        return JSONResponse(error_body(exc.status_code, exc.detail), exc.status_code, headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        return internal_error(request, exc)

    app = Starlette(
        routes=[
            Route("/v1/completions", guarded(routes.completions), methods=["POST"]),
            Route("/v1/chat/completions", guarded(routes.chat_completions), methods=["POST"]),
            Route("/v1/models", guarded(routes.models), methods=["GET"]),
            Route("/health", guarded(routes.health), methods=["GET"]),
            Route("/metrics", guarded(routes.metrics_text), methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error},
    )
    app.state.engine_loop = loop
    app.state.metrics = metrics
    return app
