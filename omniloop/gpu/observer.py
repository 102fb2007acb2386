"""Completion observers: the threads that wait so the loop never does.

``CudaObserver`` (one per CUDA stream) blocks on each step's ``torch.cuda.Event`` — created with
``blocking=True`` so the wait sleeps instead of spinning a core — in the order the steps were
recorded on the stream, then runs the step's small ``finalize`` (e.g. copying pinned buffers into
owned numpy arrays so the pinned ones can be recycled) and resolves the step's future through the
loop's doorway. ``CpuObserver`` has the same interface but runs the step function itself on its FIFO
worker thread, so a CPU step never blocks the loop.

An exception inside one step fails only that step's future. ``close()`` stops the thread, joins it
and fails every step that had not completed with ``ObserverClosed``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from omniloop.actors.doorway import Doorway
from omniloop.errors import ObserverClosed

_STOP = object()


class CompletionEvent(Protocol):
    """What a CUDA observer waits on (``torch.cuda.Event`` satisfies it)."""

    def synchronize(self) -> None: ...


class _FifoObserver:
    """A worker thread taking jobs in submission order; submit/close belong to the loop's thread."""

    def __init__(self, doorway: Doorway, name: str) -> None:
        self.name = name
        self._doorway = doorway
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: set[asyncio.Future] = set()
        self._is_closing = False  # read by the worker without a lock: a stale read runs one more job
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return len(self._futures)

    def _enqueue(self, job: Callable[[], Any], event: CompletionEvent | None) -> asyncio.Future:
        if self._is_closing:
            raise ObserverClosed(f"observer {self.name!r} is closed; cannot take a new step")
        future = self._doorway.loop.create_future()
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)
        self._jobs.put((future, event, job))
        return future

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            future, event, job = item
            if self._is_closing:
                continue  # close() fails these futures itself
            try:
                if event is not None:
                    event.synchronize()
                outcome = job()
            except BaseException as exc:  # noqa: BLE001 - crosses the doorway as a value
                outcome = exc
            self._doorway.resolve(future, outcome)

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Stop after the job now running (if any), join the thread, fail what never completed."""
        if self._is_closing and not self._thread.is_alive():
            return
        self._is_closing = True
        self._jobs.put(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"observer {self.name!r}: worker thread did not stop within {timeout_s}s")
        if self._doorway.loop.is_closed():  # nobody can await them any more
            self._futures.clear()
            return
        for future in list(self._futures):
            if not future.done():
                future.set_exception(ObserverClosed(f"observer {self.name!r} closed before the step completed"))
        self._futures.clear()


class CpuObserver(_FifoObserver):
    """Runs each step function on its worker thread, one at a time, in submission order."""

    def submit(self, step: Callable[[], Any]) -> asyncio.Future:
        return self._enqueue(step, None)


class CudaObserver(_FifoObserver):
    """Waits for each step's recorded event, in stream order, then runs its ``finalize``."""

    def submit(self, event: CompletionEvent, finalize: Callable[[], Any]) -> asyncio.Future:
        return self._enqueue(finalize, event)
