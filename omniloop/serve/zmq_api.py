"""The ZeroMQ client protocol (docs/zmq-protocol.md): a ROUTER socket, transport frames, credits.

Per stream the server keeps one merged PCM backlog and a byte credit granted by the client: it sends at
most the credit, and while a client lags the engine's chunks are merged into that one backlog (the
engine is never slowed and nothing is queued per chunk). A client that vanishes is found on the next
send (ROUTER_MANDATORY -> EHOSTUNREACH) or by a once-a-second liveness probe to clients whose streams
wait for credit; its requests are aborted in every stage.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import zmq
import zmq.asyncio

from omniloop.errors import FrameError
from omniloop.log import get_logger
from omniloop.serve.api_errors import ApiError
from omniloop.serve.context import ServeContext
from omniloop.serve.engine_api import supports_chat
from omniloop.serve.generation import start_generation
from omniloop.transport.frames import decode, encode
from omniloop.transport.messages import Abort, ChatRequest, Chunk, Credit, Finish, Reason, SpeechRequest, Submit

log = get_logger(__name__)

PCM_DTYPES = ("float32", "int16")
PROBE_INTERVAL_S = 1.0
HEARTBEAT_MS = 1000


@dataclass
class ZmqStream:
    identity: bytes
    req_id: str  # the client's id; the engine sees a per-client namespaced one
    dtype: str
    credit: int = 0
    backlog: list[np.ndarray] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    seq: int = 0
    finish: Finish | None = None
    engine_id: str = ""
    task: asyncio.Task | None = None
    is_aborted: bool = False  # the client aborted it, perhaps before its task admitted it into the engine

    @property
    def num_backlog_bytes(self) -> int:
        return sum(a.nbytes for a in self.backlog)


class ZmqFrontend:
    def __init__(self, ctx: ServeContext, address: str) -> None:
        self.ctx = ctx
        self.address = address
        self._zctx = zmq.asyncio.Context()
        self._sock = self._zctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sends to a vanished client fail loudly
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)  # drops dead TCP peers from the routing table
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * HEARTBEAT_MS)
        self._sock.bind(address)
        self.streams: dict[tuple[bytes, str], ZmqStream] = {}
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._probe_loop())]

    async def close(self) -> None:
        """After the drain: cancel stream tasks (their cleanup aborts engine requests) and close."""
        for task in self._tasks:
            task.cancel()
        for stream in list(self.streams.values()):
            if stream.task is not None:
                stream.task.cancel()
        await asyncio.gather(*self._tasks, *(s.task for s in self.streams.values() if s.task), return_exceptions=True)
        self._sock.close(linger=0)
        self._zctx.term()

    # -- inbound ----------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            identity, body = frames[0].bytes, frames[1:]
            try:
                msg, arrays = decode(body)
            except FrameError as exc:
                log.warning("malformed zmq message", error=str(exc))
                if exc.req_id is not None:
                    self._send(identity, Finish(exc.req_id, Reason.ERROR.value, error=f"malformed message: {exc}"))
                continue
            if isinstance(msg, Submit):
                self._on_submit(identity, msg)
            elif isinstance(msg, Credit):
                self._on_credit(identity, msg)
            elif isinstance(msg, Abort):
                stream = self.streams.get((identity, msg.req_id))
                if stream is not None and stream.engine_id:
                    stream.is_aborted = True
                    self.ctx.engine.abort(stream.engine_id)  # type: ignore[union-attr]
                    if stream.finish is not None:  # the engine was done; only audio awaiting credit was left
                        stream.finish = Finish(stream.req_id, Reason.ABORT.value, num_frames=stream.finish.num_frames)
                        self._flush(stream)
            else:
                log.warning("unexpected zmq message kind from a client", type=type(msg).__name__)

    def _on_submit(self, identity: bytes, msg: Submit) -> None:
        key = (identity, msg.req_id)
        dtype = getattr(msg, "pcm_dtype", "float32")
        if key in self.streams:
            self._send(identity, Finish(msg.req_id, Reason.ERROR.value, error=f"req_id {msg.req_id!r} is already in use"))
            return
        error = self._check(msg.request, dtype)
        if error is not None:
            self._send(identity, Finish(msg.req_id, Reason.ERROR.value, error=error))
            return
        stream = ZmqStream(identity, msg.req_id, dtype, engine_id=f"zmq-{identity.hex()}-{msg.req_id}")
        self.streams[key] = stream
        stream.task = asyncio.create_task(self._run(stream, msg.request))

    def _check(self, request: SpeechRequest | ChatRequest, dtype: str) -> str | None:
        if dtype not in PCM_DTYPES:
            return f"pcm_dtype {dtype!r} is not one of {PCM_DTYPES}"
        if isinstance(request, ChatRequest):
            if self.ctx.engine is not None and not supports_chat(self.ctx.engine.info):
                return f"model {self.ctx.model_name} does not support chat requests"
            return None
        if not request.text.strip():
            return "text must not be empty"
        if len(request.text) > self.ctx.max_text_chars:
            return f"text is {len(request.text)} characters; the limit is {self.ctx.max_text_chars}"
        if request.ref_audio is not None:
            try:
                self.ctx.ref_audio.check(request.ref_audio)
            except ApiError as exc:
                return exc.message
        return None

    def _on_credit(self, identity: bytes, msg: Credit) -> None:
        stream = self.streams.get((identity, msg.req_id))
        if stream is not None and msg.num_bytes > 0:
            stream.credit += msg.num_bytes
            self._flush(stream)

    # -- per request --------------------------------------------------------------------------

    async def _run(self, stream: ZmqStream, request: SpeechRequest | ChatRequest) -> None:
        try:
            await self._generate(stream, request)
        except ApiError as exc:  # refused, or ended before its first output (abort, shutdown, stage_died...)
            reason = getattr(exc, "finish_reason", None) or Reason.ERROR.value
            stream.finish = Finish(stream.req_id, reason, error=exc.message)
            self._flush(stream)
        except Exception as exc:  # a bug must still end the client's stream with its one Finish
            log.exception("zmq stream failed", req_id=stream.req_id)
            stream.finish = Finish(stream.req_id, Reason.ERROR.value, error=f"internal error: {exc}")
            self._flush(stream)

    async def _generate(self, stream: ZmqStream, request: SpeechRequest | ChatRequest) -> None:
        if stream.is_aborted:  # aborted before this task first ran: the engine never saw it
            stream.finish = Finish(stream.req_id, Reason.ABORT.value)
            self._flush(stream)
            return
        gen = await start_generation(self.ctx, None, request, api="zmq", req_id=stream.engine_id)
        async for pcm, text in gen.outputs():
            if pcm is not None and len(pcm):
                stream.backlog.append(_as_dtype(pcm, stream.dtype))
            if text:
                stream.texts.append(text)
            self._flush(stream)
        reason = gen.finish_reason or Reason.ABORT.value
        error = gen.error.message if gen.error is not None else None
        stream.finish = Finish(stream.req_id, reason, error=error, num_frames=gen.num_frames)
        self._flush(stream)

    def _flush(self, stream: ZmqStream) -> None:
        """Send what the credit allows, merged into one Chunk; then the Finish once all PCM is out."""
        if stream.is_aborted:  # the client wants no more audio and grants no more credit: Finish now
            stream.backlog.clear()
        text = "".join(stream.texts) or None
        stream.texts.clear()
        arrays = {}
        if stream.backlog and stream.credit > 0:
            merged = np.concatenate(stream.backlog) if len(stream.backlog) > 1 else stream.backlog[0]
            itemsize = merged.dtype.itemsize
            n = min(len(merged), stream.credit // itemsize)
            if n > 0:
                arrays["pcm"] = merged[:n]
                stream.backlog = [merged[n:]] if n < len(merged) else []
                stream.credit -= n * itemsize
            else:
                stream.backlog = [merged]
        if arrays or text:
            self._send(stream.identity, Chunk(stream.req_id, stream.seq, text=text), arrays)
            stream.seq += 1
        if stream.finish is not None and not stream.backlog:
            self.streams.pop((stream.identity, stream.req_id), None)
            self._send(stream.identity, stream.finish)

    # -- outbound -----------------------------------------------------------------------------

    def _send(self, identity: bytes, msg: Chunk | Finish | Credit, arrays: dict | None = None) -> None:
        try:
            # NOBLOCK: credits bound what is in flight, so a full pipe means the client is gone or
            # broken; the loop must never wait on one client.
            self._sock.send_multipart([identity, *encode(msg, arrays)], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                self._drop_client(identity, "gone" if exc.errno == zmq.EHOSTUNREACH else "not reading")
            else:
                raise

    def _drop_client(self, identity: bytes, why: str) -> None:
        dropped = [s for s in self.streams.values() if s.identity == identity]
        for stream in dropped:
            self.streams.pop((identity, stream.req_id), None)
            stream.backlog.clear()
            if stream.task is not None:
                stream.task.cancel()  # Generation cleanup aborts the request in every stage
        if dropped:
            log.info("zmq client dropped; aborted its requests", why=why, num_requests=len(dropped))

    async def _probe_loop(self) -> None:
        """Liveness: a stream stalled on credit sends nothing, so probe its client once a second."""
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            waiting = {s.identity for s in list(self.streams.values()) if s.backlog and s.credit <= 0}
            for identity in waiting:
                self._send(identity, Credit("", 0))


def _as_dtype(pcm: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "int16":
        return np.rint(np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)
    return np.asarray(pcm, dtype=np.float32)


