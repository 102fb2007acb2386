"""One request's life on the engine, shared by the speech and chat endpoints.

``start_generation`` admits, validates and waits for the first output, so any failure before the first
byte is still a JSON error response. ``Generation.outputs`` then yields (pcm, text) until the Finish,
and its ``finally`` is the single place that frees the request everywhere: engine abort when it did
not finish (client went away, server shutting down), metrics, the admission gate.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import numpy as np
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from omniloop.errors import RequestError
from omniloop.serve.api_errors import ApiError
from omniloop.serve.context import ServeContext, api_error_of
from omniloop.serve.engine_api import EngineLike, is_success
from omniloop.serve.metrics import RequestTracker
from omniloop.transport.messages import ChatRequest, SpeechRequest

_STATUS_OF_REASON = {"abort": 499, "shutdown": 503, "stage_died": 503}


class StreamBroken(Exception):
    """Raised inside a raw audio stream to end it without its final bytes (see http.py)."""


class Generation:
    def __init__(self, ctx: ServeContext, engine: EngineLike, req_id: str, it: AsyncIterator[Any],
                 first: Any, tracker: RequestTracker, watcher: asyncio.Task | None) -> None:
        self.ctx, self.engine, self.req_id = ctx, engine, req_id
        self._it, self._first, self._tracker, self._watcher = it, first, tracker, watcher
        self.finish_reason: str | None = None
        self.num_frames = 0
        self.error: ApiError | None = None

    async def outputs(self, count_error: bool = True) -> AsyncIterator[tuple[np.ndarray | None, str | None]]:
        """``count_error=False`` when the caller turns a failure into an HTTP error response (whole
        files), which the app's error handler counts; see ``close``."""
        try:
            out = self._first
            while True:
                if out.pcm is not None and len(out.pcm):
                    self._tracker.on_audio(len(out.pcm))
                if out.pcm is not None or out.text:
                    yield out.pcm, out.text
                if out.finish is not None:
                    self._on_finish(out.finish)
                    return
                out = await anext(self._it)
        finally:
            await self.close(count_error)

    def _on_finish(self, finish: Any) -> None:
        self.finish_reason = finish.reason
        self.num_frames = finish.num_frames
        if not is_success(finish.reason):
            message = self.ctx.abort_message(finish.reason, finish.error)
            self.error = ApiError(_STATUS_OF_REASON.get(finish.reason, 500), message)
            self.error.finish_reason = finish.reason  # type: ignore[attr-defined]  # for the ZMQ Finish

    async def close(self, count_error: bool = True) -> None:
        """Idempotent cleanup; aborts the engine request unless it finished. ``count_error=False``
        when the failure becomes an HTTP error response, which the app's error handler counts."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._tracker.done:
            return
        if self.finish_reason is None:
            self.engine.abort(self.req_id)
            self.finish_reason = "abort"
        failed = self.error is not None or not is_success(self.finish_reason)
        self._tracker.finish(self.finish_reason, self.finish_reason if failed and count_error else None)
        self.ctx.release(self.req_id)
        with contextlib.suppress(Exception):
            await self._it.aclose()  # type: ignore[attr-defined]


class GenerationStream(StreamingResponse):
    """A streaming response that frees its Generation however the response ends: a client gone
    before the first body byte means the body iterator never runs, so its ``finally`` never would."""

    def __init__(self, gen: Generation, content: AsyncIterator[bytes], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.gen.close()


async def start_generation(ctx: ServeContext, request: Request | None, req: SpeechRequest | ChatRequest,
                           api: str, req_id: str | None = None) -> Generation:
    engine, req_id = ctx.admit(api, req_id)
    tracker = ctx.metrics.track(api)
    watcher = asyncio.create_task(_abort_on_disconnect(request, engine, req_id)) if request is not None else None
    try:
        ctx.validate(engine, req)
        it = aiter(engine.generate(req, req_id=req_id))
        first = await anext(it)
    except BaseException as exc:
        if watcher is not None:
            watcher.cancel()
        if isinstance(exc, RequestError):
            exc = api_error_of(exc)
        tracker.finish("error")  # counted in errors_total by the app's ApiError handler
        ctx.release(req_id)
        engine.abort(req_id)  # idempotent; frees whatever the engine had admitted
        if isinstance(exc, ApiError) or not isinstance(exc, Exception):
            raise exc
        raise ApiError(500, f"the engine failed the request: {exc}") from exc
    gen = Generation(ctx, engine, req_id, it, first, tracker, watcher)
    if first.finish is not None and not is_success(first.finish.reason):
        gen._on_finish(first.finish)
        await gen.close(count_error=False)
        raise gen.error  # type: ignore[misc]
    return gen


async def _abort_on_disconnect(request: Request, engine: EngineLike, req_id: str) -> None:
    """Abort as soon as the HTTP client goes away, even while no byte is being sent (the wait for
    first audio, or a non-streaming response still being generated)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            engine.abort(req_id)
            return
