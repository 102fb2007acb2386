"""Runner base classes: ``submit(plan) -> asyncio.Future`` that never blocks the loop.

A GPU runner subclasses ``Runner`` and, in ``submit``, enqueues its kernels and async copies on a
stream, records an event and hands ``(event, finalize)`` to that stream's ``CudaObserver``.
A CPU runner subclasses ``CpuRunner`` and implements ``step(plan)``, which runs on the observer's
worker thread (so it may take as long as the model needs without stalling the loop).
Both are built inside the actor, on its loop's thread, and share that loop's doorway.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from omniloop.actors.doorway import Doorway, current_doorway
from omniloop.gpu.observer import CpuObserver, _FifoObserver


class Runner:
    """Owns observers (and, in subclasses, device memory); ``close()`` releases all of them."""

    def __init__(self, doorway: Doorway | None = None) -> None:
        self.doorway = doorway or current_doorway()
        self._observers: list[_FifoObserver] = []
        self.is_closed = False

    def add_observer(self, observer: _FifoObserver) -> _FifoObserver:
        self._observers.append(observer)
        return observer

    def submit(self, plan: Any) -> asyncio.Future:
        raise NotImplementedError(f"{type(self).__name__}.submit")

    def close(self) -> None:
        """Join observer threads and fail steps still pending. Idempotent; subclasses free memory."""
        if self.is_closed:
            return
        self.is_closed = True
        errors = []
        for observer in self._observers:
            try:
                observer.close()
            except RuntimeError as exc:
                errors.append(str(exc))
        if errors:
            raise RuntimeError(f"{type(self).__name__}.close: {'; '.join(errors)}")


class CpuRunner(Runner):
    """A runner whose steps run on one FIFO worker thread."""

    def __init__(self, name: str, doorway: Doorway | None = None) -> None:
        super().__init__(doorway)
        self._observer = self.add_observer(CpuObserver(self.doorway, name=f"{name}-cpu-step"))

    def submit(self, plan: Any) -> asyncio.Future:
        return self._observer.submit(functools.partial(self.step, plan))

    def step(self, plan: Any) -> Any:
        """Run one step (on the worker thread) and return a result the scheduler's ``update`` takes."""
        raise NotImplementedError(f"{type(self).__name__}.step")
