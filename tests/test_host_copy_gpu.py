"""The pinned ring on a GPU: copies staged behind a busy stream, more of them than the ring holds, all land
intact (a segment is rewritten only after the copies from it ran), from two threads and two streams at once."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from omniloop.gpu.host_copy import RING_BYTES, ring_for, to_device

pytestmark = pytest.mark.gpu


def _cycle(stream: torch.cuda.Stream, seed: int, out: dict) -> None:
    dev = torch.device("cuda")
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 1 << 40, size=20_000, dtype=np.int64) for _ in range(3 * RING_BYTES // 160_000)]
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the copies queue behind ~tens of ms of GPU time
        got = [to_device(a, dev) for a in arrays]  # 160 KB each: the ring cycles three times
        dst = torch.empty(3, dtype=torch.bool, device=dev)
        to_device(np.array([True, False, True]), dev, out=dst)
    stream.synchronize()
    out[seed] = (all(torch.equal(g.cpu(), torch.from_numpy(a)) for g, a in zip(got, arrays)),
                 dst.tolist(), ring_for(dev).num_fence_waits)


def test_copies_behind_a_busy_stream_survive_the_ring_cycling() -> None:
    out: dict = {}
    threads = [threading.Thread(target=_cycle, args=(torch.cuda.Stream(), seed, out)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed in (1, 2):
        intact, flags, waits = out[seed]
        assert intact and flags == [True, False, True]
        assert waits > 0  # the ring did come back to segments whose copies were still queued
