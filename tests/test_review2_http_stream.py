"""Review 2: the HTTP layer's bookkeeping around streaming and whole-file responses.

Driven straight through the ASGI app with a scripted engine, so each path is deterministic.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from omniloop.serve.context import ServeContext
from omniloop.serve.http import build_app
from omniloop.serve.metrics import ServeMetrics
from omniloop.serve.ref_audio import RefAudioResolver
from omniloop.transport.messages import Finish


@dataclass
class Out:
    pcm: np.ndarray | None = None
    text: str | None = None
    finish: Finish | None = None


class ScriptedEngine:
    """First output at once; then waits (until aborted) before its Finish."""

    def __init__(self, finish_reason: str = "stop", error: str | None = None) -> None:
        self.info = SimpleNamespace(name="fake", speakers=(), languages=(), task_types=())
        self.is_ready = True
        self.aborted: list[str] = []
        self.finish_reason, self.error = finish_reason, error
        self._aborted = asyncio.Event()

    def validate(self, request) -> None:
        pass

    async def generate(self, request, req_id=None):
        yield Out(pcm=np.full(240, 0.25, np.float32))
        if self.finish_reason == "hang":
            await self._aborted.wait()
            yield Out(finish=Finish(req_id, "abort"))
            return
        yield Out(finish=Finish(req_id, self.finish_reason, error=self.error))

    def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)
        self._aborted.set()

    def stats(self) -> dict:
        return {}


def _ctx(engine) -> ServeContext:
    return ServeContext("fake", 512, ServeMetrics(), RefAudioResolver([]), engine=engine)


def _scope(path: str, spec_version: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "headers": [(b"content-type", b"application/json")],
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1234)}


async def _call(app, path: str, body: dict, send, spec_version: str = "2.4") -> None:
    sent_body = False
    never = asyncio.Event()

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await never.wait()  # the client stays (silently) connected as far as receive() knows
        return {"type": "http.disconnect"}

    try:
        await app(_scope(path, spec_version), receive, send)
    except Exception:
        pass  # a disconnected client's send error surfaces as ClientDisconnect; irrelevant here


async def test_stream_whose_client_is_gone_before_the_body_starts_frees_the_request():
    # ASGI spec >= 2.4: send() raises OSError once the client is gone. Here it is gone before the
    # response start could be sent, so the body iterator never runs; the request must still be aborted
    # in the engine and released from the admission gate and the running gauge.
    engine = ScriptedEngine("hang")
    ctx = _ctx(engine)
    app = build_app(ctx)

    async def send(message):
        if message["type"] == "http.response.start" and message["status"] == 200:
            raise OSError("client went away")

    for body in ({"input": "hello", "stream_format": "audio", "response_format": "pcm"},
                 {"input": "hello", "stream": True}):
        await asyncio.wait_for(_call(app, "/v1/audio/speech", body, send), 5)
        await asyncio.sleep(0)
        assert not ctx.in_flight, body
        assert ctx.metrics.num_running == 0, body
    assert len(engine.aborted) == 2
    assert not [t for t in asyncio.all_tasks() if "_abort_on_disconnect" in repr(t.get_coro())]


async def test_a_failed_whole_file_request_is_counted_once_in_errors_total():
    engine = ScriptedEngine("error", error="decoder blew up")
    ctx = _ctx(engine)
    app = build_app(ctx)
    statuses: list[int] = []

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await asyncio.wait_for(_call(app, "/v1/audio/speech", {"input": "hello"}, send), 5)
    assert statuses == [500]
    assert sum(ctx.metrics.errors.values.values()) == 1, dict(ctx.metrics.errors.values)
    assert ctx.metrics.num_running == 0 and not ctx.in_flight
