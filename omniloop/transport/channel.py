"""Typed ZMQ channels: an ``Inbox`` (PULL, binds) and an ``Outbox`` (PUSH, connects).

Addresses: ``inproc://`` (threads of one process; needs the shared context), ``ipc://`` (default
between processes; socket files live in a per-run directory the supervisor removes), ``tcp://``.

An inbox wakes its event loop through ``loop.add_reader`` on the socket's ``zmq.FD`` — no timers.
That FD is edge-triggered and only says "events changed", so every wake-up drains while
``zmq.EVENTS`` reports POLLIN; a wake-up handles at most ``max_batch`` messages and re-arms itself with
``call_soon`` for the rest, so one busy peer cannot starve the loop's other callbacks.

A socket belongs to the thread of the loop it is attached to: sockets are not thread-safe, and
everything that arrives from other threads comes through the loop's doorway instead.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable

import numpy as np
import zmq

from omniloop.errors import FrameError
from omniloop.log import get_logger
from omniloop.transport.frames import decode, encode
from omniloop.transport.messages import Message

log = get_logger(__name__)

DEFAULT_HWM = 10_000
DEFAULT_SEND_LINGER_MS = 500
MAX_BATCH = 256

Delivery = tuple[Message, dict[str, np.ndarray]] | FrameError

_context_lock = threading.Lock()
_context: zmq.Context | None = None
_context_users = 0


def acquire_context() -> zmq.Context:
    """The process's one ZMQ context (inproc only works within one context). Reference counted so
    that the last ``release_context`` terminates it and no ZMQ I/O thread outlives the engine."""
    global _context, _context_users
    with _context_lock:
        if _context is None:
            _context = zmq.Context()
        _context_users += 1
        return _context


def release_context() -> None:
    global _context, _context_users
    with _context_lock:
        if _context_users <= 0:
            raise RuntimeError("release_context() without a matching acquire_context()")
        _context_users -= 1
        if _context_users == 0 and _context is not None:
            _context.term()
            _context = None


def context_users() -> int:
    """How many channels hold the shared context (0 once everything is closed)."""
    with _context_lock:
        return _context_users


class Inbox:
    """PULL socket bound at ``address``; delivers decoded messages to the owning loop in batches."""

    def __init__(self, address: str, *, hwm: int = DEFAULT_HWM, name: str = "inbox") -> None:
        self.address = address
        self.name = name
        self._ctx = acquire_context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as exc:
            self._sock.close()
            release_context()
            raise OSError(f"{name}: cannot bind {address}: {exc}") from exc
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_batch: Callable[[list[Delivery]], None] | None = None
        self._is_closed = False

    def attach(self, loop: asyncio.AbstractEventLoop, on_batch: Callable[[list[Delivery]], None]) -> None:
        """Start delivering to ``on_batch`` on ``loop`` (call from the loop's thread)."""
        self._loop, self._on_batch = loop, on_batch
        loop.add_reader(self._sock.getsockopt(zmq.FD), self._drain)
        # Messages that arrived before add_reader produced their edge already; look once now.
        loop.call_soon(self._drain)

    def _drain(self) -> None:
        if self._is_closed or self._on_batch is None:
            return
        batch: list[Delivery] = []
        while len(batch) < MAX_BATCH and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            try:
                batch.append(decode(frames))
            except FrameError as exc:
                batch.append(exc)
        if len(batch) == MAX_BATCH and self._loop is not None:
            self._loop.call_soon(self._drain)
        if batch:
            self._on_batch(batch)

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
        self._sock.close(linger=0)
        release_context()


class Outbox:
    """PUSH socket connected to ``address``. ``send`` never blocks the loop: when the peer's queue is
    full (HWM) messages wait, in order, in a backlog flushed when the socket becomes writable.

    The backlog is the owner's signal to stop producing (``is_congested``): a stage launches no new step
    while an outbox of its has one, so a peer that stopped reading holds the backlog to what the steps
    already in flight emit. ``on_drain`` is called on the loop when the backlog has emptied."""

    def __init__(
        self,
        address: str,
        *,
        hwm: int = DEFAULT_HWM,
        linger_ms: int = DEFAULT_SEND_LINGER_MS,
        name: str = "outbox",
    ) -> None:
        self.address = address
        self.name = name
        self._ctx = acquire_context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, linger_ms)
        self._sock.connect(address)
        self._backlog: collections.deque[list] = collections.deque()
        self.on_drain: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owner: int | None = None
        self._is_closed = False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind the outbox to ``loop``'s thread; needed for the non-blocking backlog."""
        self._loop, self._owner = loop, threading.get_ident()

    def send(self, msg: Message, arrays: dict[str, np.ndarray] | None = None) -> None:
        if self._is_closed:
            raise RuntimeError(f"{self.name}: send on a closed outbox ({self.address})")
        if self._owner is not None and threading.get_ident() != self._owner:
            raise RuntimeError(f"{self.name}: send from a thread that does not own the outbox")
        frames = encode(msg, arrays)
        if self._backlog:
            self._backlog.append(frames)
            return
        if self._loop is None:
            self._sock.send_multipart(frames, copy=False)
            return
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._backlog.append(frames)
            log.warning("outbox_backlog", outbox=self.name, address=self.address)
            self._loop.add_reader(self._sock.getsockopt(zmq.FD), self._flush)
            self._loop.call_soon(self._flush)

    @property
    def num_backlog(self) -> int:
        return len(self._backlog)

    @property
    def is_congested(self) -> bool:
        """The peer is not keeping up: messages wait in the backlog."""
        return bool(self._backlog)

    def _flush(self) -> None:
        while self._backlog and not self._is_closed and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
            self._sock.send_multipart(self._backlog.popleft(), zmq.NOBLOCK, copy=False)
        if not self._backlog and not self._is_closed and self._loop is not None:
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
            log.info("outbox_drained", outbox=self.name, address=self.address)
            if self.on_drain is not None:
                self.on_drain()

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self._backlog:
            log.warning("outbox_dropped", outbox=self.name, num_messages=len(self._backlog))
            self._backlog.clear()
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
        self._sock.close()
        release_context()
