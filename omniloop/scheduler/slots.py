"""Slot ids: a request's row in the runner's batch state (graph buffers, codec streaming state)."""

from __future__ import annotations

import heapq


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need num_slots >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a heap: lowest id first keeps busy rows packed at the front

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)
