"""The one way into an event loop from another thread.

Observer threads (CUDA events, CPU steps), the supervisor's process watcher and actor threads all
reach a loop only through its ``Doorway``; nothing else in omniloop calls ``call_soon_threadsafe``.
The doorway

- coalesces: posts land in a lock-protected list and only the post that makes the list non-empty
  schedules the drain, so a burst of completions costs one loop wake-up, not one each;
- tolerates a closed loop: posts after close are dropped (the owner is gone, so is its state);
- skips futures that were cancelled (or failed by a close) while the result was travelling;
- carries exceptions as values: ``resolve(future, exc)`` re-raises on the owner's side, when awaited.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from omniloop.log import get_logger

log = get_logger(__name__)

_doorways_lock = threading.Lock()
_doorways: dict[int, Doorway] = {}


class Doorway:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._is_closed = False
        self.num_wakeups = 0  # drains run; with coalescing this stays below the number of posts

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop's thread, soon. Safe from any thread; never blocks on the loop."""
        with self._lock:
            if self._is_closed:
                return
            is_first = not self._pending
            self._pending.append((fn, args))
        if not is_first:
            return
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed between our check and the call: the owner is gone
            with self._lock:
                self._pending.clear()

    def resolve(self, future: asyncio.Future, outcome: Any) -> None:
        """Complete ``future`` on its loop with ``outcome``; an exception instance fails it instead."""
        self.post(_settle, future, outcome)

    def close(self) -> None:
        """Stop accepting posts (call from the loop's thread as the owner shuts down)."""
        with self._lock:
            self._is_closed = True
            self._pending.clear()
        with _doorways_lock:
            if _doorways.get(id(self._loop)) is self:
                del _doorways[id(self._loop)]

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        self.num_wakeups += 1
        for fn, args in batch:
            try:
                fn(*args)
            except Exception:
                # One bad callback must not drop the completions queued behind it.
                log.exception("doorway_callback_failed", callback=getattr(fn, "__qualname__", repr(fn)))


def _settle(future: asyncio.Future, outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def doorway_for(loop: asyncio.AbstractEventLoop) -> Doorway:
    """The loop's doorway, created on first use, so every component of an actor shares one and
    completions from all of them coalesce into the same wake-up."""
    with _doorways_lock:
        doorway = _doorways.get(id(loop))
        if doorway is None or doorway.loop is not loop:
            doorway = _doorways[id(loop)] = Doorway(loop)
        return doorway


def current_doorway() -> Doorway:
    """The doorway of the running loop (call from the loop's thread)."""
    return doorway_for(asyncio.get_running_loop())
