"""Host-to-device copies that never wait for the GPU.

A pageable host-to-device copy is synchronous with the stream: it waits for the step in flight, which the
async overlap must not do. On CUDA every small per-step input therefore goes through pinned memory with a
non-blocking copy. The pinned memory is a ring per thread and device (``PinnedRing``), allocated once and
reused round-robin: ``Tensor.pin_memory()`` per copy asked torch's caching host allocator for a block each time
(~0.1 ms of host time a call on the H200 host; ~0.4 ms of the talker loop thread a frame step, py-spy,
benchmarks/pipeline.md). Arrays larger than a ring segment, and copies made while a CUDA graph is being
captured, keep the per-copy pinned block. On CPU it is a plain copy (or none).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

RING_BYTES = 16 << 20  # per thread and device
RING_SEGMENTS = 32  # a segment is reused only after the copies from it have run (an event per segment)
ALIGN = 64

_local = threading.local()


class PinnedRing:
    """A pinned host buffer in ``segments`` equal parts, handed out front to back. Leaving a segment records an
    event after the copies issued from it (on their stream); the ring moves on to a segment only once that
    segment's event has passed, and never waits for it: while the next segment is still in use the ring is
    full and ``stage`` returns None (the caller pins a block of its own). A step's inputs are a few KB to a few
    hundred KB, so with 32 segments of 512 KB the ring is full only if the GPU is far behind. A stream change
    inside a segment closes the segment, so one event always covers every copy from it.

    ``pin`` and ``record`` are for tests on machines without CUDA (``record(stream)`` returns an object with
    ``query()``, True once the copies before it have run)."""

    def __init__(self, nbytes: int = RING_BYTES, segments: int = RING_SEGMENTS, *, pin: bool = True,
                 record: Callable[[Any], Any] | None = None) -> None:
        if nbytes // segments < ALIGN:
            raise ValueError(f"a ring of {nbytes} bytes in {segments} segments: segments under {ALIGN} bytes")
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host = self.buf.numpy()
        self.segment_bytes = nbytes // segments
        self.num_segments = segments
        self._record = record or _record_event
        self._fences: list[Any] = [None] * segments
        self._segment, self._offset = 0, 0
        self._stream: Any = None  # the stream the current segment's copies went to
        self.num_full = 0  # arrays refused because the next segment was still in use (tests, diagnostics)

    def stage(self, array: np.ndarray, stream: Any = None) -> torch.Tensor | None:
        """A tensor in the ring holding a copy of ``array`` (its dtype and shape), for copies on ``stream``
        issued before the next ``stage`` call on another stream; None if it does not fit in a segment or the
        ring is full."""
        nbytes = array.nbytes
        if nbytes > self.segment_bytes:
            return None
        if self._offset and (self._offset + nbytes > self.segment_bytes or stream != self._stream):
            if not self._next_segment():
                self.num_full += 1
                return None
        self._stream = stream
        start = self._segment * self.segment_bytes + self._offset
        self._offset += -(-nbytes // ALIGN) * ALIGN
        self.host[start:start + nbytes].view(array.dtype).reshape(array.shape)[...] = array
        return self.buf[start:start + nbytes].view(_torch_dtype(array.dtype)).view(array.shape)

    def _next_segment(self) -> bool:
        """Close the current segment and open the next one, if the copies from that one's last use have run."""
        following = (self._segment + 1) % self.num_segments
        fence = self._fences[following]
        if fence is not None and not fence.query():
            return False
        self._fences[self._segment] = self._record(self._stream)
        self._fences[following] = None
        self._segment, self._offset = following, 0
        return True


def _record_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


_DTYPES: dict[np.dtype, torch.dtype] = {}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    if dtype not in _DTYPES:
        _DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return _DTYPES[dtype]


def ring_for(device: torch.device) -> PinnedRing:
    """This thread's ring for ``device`` (made on first use; freed with the thread)."""
    rings = getattr(_local, "rings", None)
    if rings is None:
        rings = _local.rings = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    ring = rings.get(index)
    if ring is None:
        ring = rings[index] = PinnedRing()
    return ring


def _pinned(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``data`` in pinned memory: in this thread's ring where it can be, else in a block of its own."""
    t = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    if t.dtype in _NOT_IN_NUMPY or t.requires_grad or torch.cuda.is_current_stream_capturing():
        return t.pin_memory()
    array = data if isinstance(data, np.ndarray) else t.numpy()
    staged = ring_for(device).stage(array, torch.cuda.current_stream(device))
    return t.pin_memory() if staged is None else staged


_NOT_IN_NUMPY = (torch.bfloat16, torch.complex32)


def to_device(data: np.ndarray | torch.Tensor, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """``data`` (a numpy array or a tensor) on ``device``, or copied into ``out`` (then returned)."""
    if device.type == "cuda" and (isinstance(data, np.ndarray) or data.device.type == "cpu"):
        t = _pinned(data, device)
        return out.copy_(t, non_blocking=True) if out is not None else t.to(device, non_blocking=True)
    t = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    return out.copy_(t) if out is not None else t.to(device)
