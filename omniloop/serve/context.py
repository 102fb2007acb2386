"""What every front end (HTTP, ZMQ) shares: the engine, metrics, limits and the admission gate.

The gate is the one place that knows whether the server still admits requests and which requests are
in flight, so a graceful shutdown can wait for them and abort the stragglers.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from omniloop.errors import RequestError
from omniloop.serve.api_errors import ApiError
from omniloop.serve.engine_api import EngineLike
from omniloop.serve.metrics import ServeMetrics
from omniloop.serve.ref_audio import RefAudioResolver
from omniloop.transport.messages import ChatRequest, SpeechRequest

SHUTDOWN_MESSAGE = "the server is shutting down; the request was aborted after the drain timeout"


@dataclass
class ServeContext:
    model_name: str
    max_text_chars: int
    metrics: ServeMetrics
    ref_audio: RefAudioResolver
    engine: EngineLike | None = None  # None while the engine is starting
    is_draining: bool = False
    is_shutdown_abort: bool = False  # set when the drain timeout expired and stragglers were aborted
    in_flight: set[str] = field(default_factory=set)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and bool(self.engine.is_ready) and not self.is_draining

    def served_names(self) -> set[str]:
        names = {self.model_name}
        if self.engine is not None:
            names.add(str(getattr(self.engine.info, "name", self.model_name)))
        return names

    def admit(self, prefix: str, req_id: str | None = None) -> tuple[EngineLike, str]:
        """Reserve a slot for a new request or raise 503 (starting / draining)."""
        if self.is_draining:
            raise ApiError(503, "the server is shutting down and admits no new requests")
        if self.engine is None or not self.engine.is_ready:
            raise ApiError(503, "the engine is still starting; retry when GET /ready returns 200",
                           headers={"Retry-After": "1"})
        req_id = req_id or f"{prefix}-{uuid.uuid4().hex}"
        self.in_flight.add(req_id)
        self._idle.clear()
        return self.engine, req_id

    def release(self, req_id: str) -> None:
        self.in_flight.discard(req_id)
        if not self.in_flight:
            self._idle.set()

    def validate(self, engine: EngineLike, request: SpeechRequest | ChatRequest) -> None:
        try:
            engine.validate(request)
        except RequestError as exc:
            raise api_error_of(exc) from None

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting, wait up to ``timeout_s`` for in-flight requests, abort the rest.
        Returns how many were aborted."""
        self.is_draining = True
        if not self.in_flight:
            return 0
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return 0
        except asyncio.TimeoutError:
            pass
        self.is_shutdown_abort = True
        stragglers = list(self.in_flight)
        if self.engine is not None:
            for req_id in stragglers:
                self.engine.abort(req_id)
        # Aborted streams end with their Finish; give them a moment to send the terminal error.
        try:
            await asyncio.wait_for(self._idle.wait(), 5.0)
        except asyncio.TimeoutError:
            pass
        return len(stragglers)

    def abort_message(self, reason: str, error: str | None) -> str:
        if self.is_shutdown_abort and reason in ("abort", "shutdown"):
            return SHUTDOWN_MESSAGE
        return error or f"the request ended with reason {reason!r}"


def api_error_of(exc: RequestError) -> ApiError:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return ApiError(exc.status, exc.message, headers=headers)
