"""``to_device``: the one host-to-device copy helper (numpy or tensor in; into ``out`` or a new tensor). The
CUDA branch (pinned, non-blocking) is exercised by the GPU tests, which run every plan under
``torch.cuda.set_sync_debug_mode("error")`` (and ``test_kernels_gpu`` cycles the pinned ring behind a busy stream);
here the CPU branch's contract and the ring's bookkeeping, with unpinned memory and recorded fences."""

import numpy as np
import torch

from omniloop.gpu.host_copy import PinnedRing, to_device


def test_to_device_on_cpu_copies_arrays_and_tensors_into_out_or_new() -> None:
    cpu = torch.device("cpu")
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    t = to_device(a, cpu)
    assert t.dtype == torch.int64 and t.tolist() == a.tolist()
    out = torch.full((2, 3), -1, dtype=torch.int64)
    got = to_device(a, cpu, out)
    assert got is out and out.tolist() == a.tolist()
    src = torch.tensor([1.5, 2.5])
    assert to_device(src, cpu) is src  # already there: no copy
    out2 = torch.zeros(2)
    assert to_device(src, cpu, out2) is out2 and out2.tolist() == [1.5, 2.5]


class _Fence:
    def __init__(self, log: list, stream) -> None:
        self.log, self.stream, self.passed = log, stream, False
        log.append(("record", stream))

    def query(self) -> bool:
        return self.passed


def _ring(nbytes: int = 1024, segments: int = 4) -> tuple[PinnedRing, list, list]:
    log: list = []
    fences: list = []

    def record(stream):
        fences.append(_Fence(log, stream))
        return fences[-1]

    return PinnedRing(nbytes, segments, pin=False, record=record), log, fences


def test_the_ring_stages_each_dtype_and_shape_aligned() -> None:
    ring, _, _ = _ring(4096, 4)
    arrays = [np.arange(6, dtype=np.int64).reshape(2, 3), np.array([True, False, True]),
              np.linspace(0, 1, 5, dtype=np.float32), np.arange(7, dtype=np.int32)[::2], np.zeros((0, 4))]
    staged = [ring.stage(a) for a in arrays]
    for a, t in zip(arrays, staged):
        assert t.shape == a.shape and t.numpy().dtype == a.dtype and (t.numpy() == a).all()
    starts = [t.data_ptr() - ring.buf.data_ptr() for t in staged[:-1]]  # the empty one has no place
    assert starts == sorted(starts) and all(s % 64 == 0 and 0 <= s < 1024 for s in starts)
    assert ring.stage(np.zeros(1024 // 8 + 1)) is None  # larger than a segment: the caller pins its own


def test_a_segment_is_reused_only_after_its_fence_passed_and_the_ring_never_waits() -> None:
    ring, log, fences = _ring(1024, 4)  # segments of 256 bytes; 200-byte arrays take one each
    first = ring.stage(np.full(25, 7, dtype=np.int64), "s")
    for k in range(3):
        ring.stage(np.full(25, k, dtype=np.int64), "s")
    assert log == [("record", "s")] * 3 and (first.numpy() == 7).all()
    # back to segment 0, whose copies have not run: full, nothing overwritten, no wait
    assert ring.stage(np.full(25, 9, dtype=np.int64), "s") is None
    assert ring.num_full == 1 and (first.numpy() == 7).all() and len(fences) == 3
    fences[0].passed = True
    again = ring.stage(np.full(25, 9, dtype=np.int64), "s")
    assert again.data_ptr() == first.data_ptr() and (first.numpy() == 9).all()
    assert len(fences) == 4  # segment 3 closed on the way


def test_a_stream_change_closes_the_segment_under_the_old_stream() -> None:
    ring, log, _ = _ring(1024, 4)
    a = ring.stage(np.ones(2, dtype=np.int64), "s1")
    b = ring.stage(np.ones(2, dtype=np.int64), "s1")
    assert b.data_ptr() - a.data_ptr() == 64 and log == []  # same stream, same segment
    c = ring.stage(np.ones(2, dtype=np.int64), "s2")
    assert log == [("record", "s1")] and c.data_ptr() - a.data_ptr() == 256


def test_a_ring_of_too_small_segments_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="segments"):
        PinnedRing(256, 8, pin=False)
