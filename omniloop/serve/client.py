"""Python clients for the ZeroMQ protocol (docs/zmq-protocol.md): ``Client`` (blocking) and
``AsyncClient`` (asyncio, uvloop included). Both grant credit automatically: a window up front, then
each chunk's bytes back once the caller has taken the chunk, so a slow consumer slows the server's
sending (it merges PCM meanwhile) instead of filling memory on either side.

    with Client("tcp://127.0.0.1:5555") as client:
        pcm, finish = client.speak("Hello there", speaker="vivian")
        for item in client.stream("Hello again"):
            play(item.pcm) if item.pcm is not None else None   # last item: item.finish
"""

from __future__ import annotations

import asyncio
import collections
import os
import uuid
from typing import Any, AsyncIterator, Iterator, NamedTuple

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from omniloop.transport.frames import decode, encode
from omniloop.transport.messages import Abort, ChatRequest, Chunk, Credit, Finish, Sampling, SpeechRequest, Submit

DEFAULT_WINDOW_BYTES = 4 * 24000 * 4  # 4 s of float32 audio in flight
_SAMPLING_FIELDS = set(Sampling.__struct_fields__)
_WIRE_DTYPE_FIELD = "pcm_dtype" in Submit.__struct_fields__


class StreamItem(NamedTuple):
    """One piece of a stream; the last item has ``finish`` set (and usually no payload)."""

    pcm: np.ndarray | None
    text: str | None
    finish: Finish | None


def speech_request(text: str, **fields: Any) -> SpeechRequest:
    """A SpeechRequest from flat keyword arguments; sampling keys (seed, temperature, top_k, top_p,
    repetition_penalty, ...) go into ``sampling``; ``ref_audio`` may be bytes or a file path."""
    sampling = {k: fields.pop(k) for k in list(fields) if k in _SAMPLING_FIELDS}
    ref_audio = fields.get("ref_audio")
    if isinstance(ref_audio, (str, os.PathLike)):
        with open(ref_audio, "rb") as f:
            fields["ref_audio"] = f.read()
    return SpeechRequest(text=text, sampling=Sampling(**sampling), **fields)


def _submit_frames(req_id: str, request: SpeechRequest | ChatRequest, dtype: str) -> list:
    if dtype not in ("float32", "int16"):
        raise ValueError(f"dtype must be float32 or int16, not {dtype!r}")
    submit = Submit(req_id, request)
    if _WIRE_DTYPE_FIELD and dtype != "float32":
        submit = msgspec.structs.replace(submit, pcm_dtype=dtype)
    return encode(submit)


def _local_dtype(pcm: np.ndarray, dtype: str) -> np.ndarray:
    """Without wire-side int16 support the server sends float32; convert here."""
    if dtype == "int16" and pcm.dtype != np.int16:
        return np.rint(np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)
    return pcm


class Client:
    """Blocking client; one stream at a time per thread (a ZMQ socket is not thread-safe)."""

    def __init__(self, address: str, window_bytes: int = DEFAULT_WINDOW_BYTES, timeout_s: float = 300.0) -> None:
        self.window_bytes = window_bytes
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        self._sock.connect(address)
        self._stash: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._abandoned: set[str] = set()

    def speak(self, text: str, dtype: str = "float32", **fields: Any) -> tuple[np.ndarray, Finish]:
        """The whole utterance and its Finish (check ``finish.reason``/``finish.error``)."""
        pieces, finish = [], None
        for item in self.stream(text, dtype=dtype, **fields):
            if item.pcm is not None:
                pieces.append(item.pcm)
            finish = item.finish or finish
        assert finish is not None
        empty = np.zeros(0, dtype=np.dtype(dtype))
        return (np.concatenate(pieces) if pieces else empty), finish

    def stream(self, text: str | None = None, *, request: SpeechRequest | ChatRequest | None = None,
               dtype: str = "float32", req_id: str | None = None, **fields: Any) -> Iterator[StreamItem]:
        request = request or speech_request(text or "", **fields)
        req_id = req_id or uuid.uuid4().hex
        self._sock.send_multipart(_submit_frames(req_id, request, dtype))
        self._sock.send_multipart(encode(Credit(req_id, self.window_bytes)))
        finished = False
        try:
            while True:
                msg, arrays = self._next_for(req_id)
                if isinstance(msg, Finish):
                    finished = True
                    yield StreamItem(None, None, msg)
                    return
                pcm = arrays.get("pcm")
                yield StreamItem(None if pcm is None else _local_dtype(pcm, dtype), msg.text, None)
                if pcm is not None and pcm.nbytes:
                    self._sock.send_multipart(encode(Credit(req_id, pcm.nbytes)))
        finally:
            if not finished:
                self._abandoned.add(req_id)
                self._stash.pop(req_id, None)
                self._sock.send_multipart(encode(Abort(req_id)))

    def _next_for(self, req_id: str) -> tuple[Any, dict[str, np.ndarray]]:
        stash = self._stash.get(req_id)
        if stash:
            return stash.popleft()
        while True:
            if not self._sock.poll(self.timeout_ms):
                raise TimeoutError(f"no message from the server for request {req_id!r} in {self.timeout_ms} ms")
            msg, arrays = decode(self._sock.recv_multipart(copy=False))
            if not isinstance(msg, (Chunk, Finish)):
                continue  # server liveness probes (Credit with empty req_id)
            if msg.req_id == req_id:
                return msg, arrays
            if msg.req_id not in self._abandoned:
                self._stash[msg.req_id].append((msg, arrays))

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient:
    """asyncio client; any number of concurrent streams on one socket."""

    def __init__(self, address: str, window_bytes: int = DEFAULT_WINDOW_BYTES) -> None:
        self.window_bytes = window_bytes
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        self._sock.connect(address)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def speak(self, text: str, dtype: str = "float32", **fields: Any) -> tuple[np.ndarray, Finish]:
        pieces, finish = [], None
        async for item in self.stream(text, dtype=dtype, **fields):
            if item.pcm is not None:
                pieces.append(item.pcm)
            finish = item.finish or finish
        assert finish is not None
        return (np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.dtype(dtype))), finish

    async def stream(self, text: str | None = None, *, request: SpeechRequest | ChatRequest | None = None,
                     dtype: str = "float32", req_id: str | None = None, **fields: Any) -> AsyncIterator[StreamItem]:
        request = request or speech_request(text or "", **fields)
        req_id = req_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[req_id] = queue
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        await self._sock.send_multipart(_submit_frames(req_id, request, dtype))
        await self._sock.send_multipart(encode(Credit(req_id, self.window_bytes)))
        finished = False
        try:
            while True:
                msg, arrays = await queue.get()
                if isinstance(msg, BaseException):
                    raise msg
                if isinstance(msg, Finish):
                    finished = True
                    yield StreamItem(None, None, msg)
                    return
                pcm = arrays.get("pcm")
                yield StreamItem(None if pcm is None else _local_dtype(pcm, dtype), msg.text, None)
                if pcm is not None and pcm.nbytes:
                    await self._sock.send_multipart(encode(Credit(req_id, pcm.nbytes)))
        finally:
            self._queues.pop(req_id, None)
            if not finished and not self._sock.closed:
                self._sock.send_multipart(encode(Abort(req_id)), flags=zmq.NOBLOCK)

    async def _read(self) -> None:
        try:
            while True:
                msg, arrays = decode(await self._sock.recv_multipart(copy=False))
                if isinstance(msg, (Chunk, Finish)) and msg.req_id in self._queues:
                    self._queues[msg.req_id].put_nowait((msg, arrays))
        except Exception as exc:  # a broken socket must not leave streams waiting forever
            for queue in self._queues.values():
                queue.put_nowait((exc, {}))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
