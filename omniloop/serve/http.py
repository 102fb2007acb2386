"""The Starlette app: routes, API-key check, error shape, and quiet ends of broken raw streams."""

from __future__ import annotations

import hmac
import time
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from omniloop.log import get_logger
from omniloop.serve.api_errors import ApiError, reason_label
from omniloop.serve.chat_api import create_chat
from omniloop.serve.context import ServeContext
from omniloop.serve.generation import StreamBroken
from omniloop.serve.request_body import read_body
from omniloop.serve.speech_api import create_speech

log = get_logger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # base64 reference audio is the biggest legitimate body
PUBLIC_PATHS = frozenset({"/health"})


def build_app(ctx: ServeContext, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ASGIApp:
    def post(handler: Callable[[ServeContext, Request, bytes], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await handler(ctx, request, await read_body(request, max_body_bytes))
        return endpoint

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(_: Request) -> Response:
        if ctx.is_ready:
            return JSONResponse({"status": "ready"})
        state = "draining" if ctx.is_draining else "starting"
        return JSONResponse({"status": state}, status_code=503)

    async def models(_: Request) -> Response:
        card = {"id": ctx.model_name, "object": "model", "created": _STARTED, "owned_by": "omniloop"}
        return JSONResponse({"object": "list", "data": [card]})

    async def voices(_: Request) -> Response:
        info = _engine_info(ctx)
        return JSONResponse({
            "voices": list(getattr(info, "speakers", ())),
            "languages": list(getattr(info, "languages", ())),
            "task_types": list(getattr(info, "task_types", ())),
            "uploaded_voices": [],
        })

    async def metrics(_: Request) -> Response:
        stats = None
        if ctx.engine is not None:
            refresh = getattr(ctx.engine, "refresh_stats", None)  # fresh per-stage step times
            stats = await refresh(timeout_s=0.5) if refresh is not None and ctx.engine.is_ready else ctx.engine.stats()
        body = ctx.metrics.render(stats, ctx.is_ready, ctx.is_draining)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        ctx.metrics.errors.inc(reason=reason_label(exc.status))
        return exc.response()

    async def on_http_error(_: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        message = {404: "no such endpoint", 405: "method not allowed on this endpoint"}.get(status, str(exc))
        return on_status(status, message)

    def on_status(status: int, message: str) -> Response:
        ctx.metrics.errors.inc(reason=reason_label(status))
        return ApiError(status, message).response()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/audio/voices", voices, methods=["GET"]),
        Route("/v1/audio/speech", post(create_speech), methods=["POST"]),
        Route("/v1/chat/completions", post(create_chat), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: on_api_error, 404: on_http_error, 405: on_http_error})
    guarded: ASGIApp = QuietBrokenStreams(app)
    if api_key:
        guarded = RequireApiKey(guarded, api_key)
    return guarded


_STARTED = int(time.time())


def _engine_info(ctx: ServeContext) -> Any:
    if ctx.engine is None:
        raise ApiError(503, "the engine is still starting", headers={"Retry-After": "1"})
    return ctx.engine.info


class RequireApiKey:
    """``Authorization: Bearer <key>`` on every path but /health (liveness probes carry no secrets)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                                 headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class QuietBrokenStreams:
    """A raw audio stream that fails mid-way raises StreamBroken so the response ends without its final
    chunk (the client sees a truncated transfer). Catch it here so it is one log line, not a traceback."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except BaseExceptionGroup as group:  # Starlette streams inside a task group
            broken, rest = group.split(StreamBroken)
            if broken is None or rest is not None:
                raise
            log.warning("raw audio stream ended early", path=scope.get("path"), error=str(broken.exceptions[0]))
        except StreamBroken as exc:
            log.warning("raw audio stream ended early", path=scope.get("path"), error=str(exc))
