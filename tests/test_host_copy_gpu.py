"""The pinned ring on a GPU: copies staged behind a busy stream, more of them than the ring holds, all land
intact (a segment is rewritten only after the copies from it ran; a full ring hands out no memory), from two
threads and two streams at once."""

from __future__ import annotations

import gc
import threading
import time
import weakref

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
        torch.cuda._sleep(200_000_000)  # the copies queue behind ~0.1 s of GPU time
        got = [to_device(a, dev) for a in arrays]  # 160 KB each: three rings' worth
        dst = torch.empty(3, dtype=torch.bool, device=dev)
        to_device(np.array([True, False, True]), dev, out=dst)
    stream.synchronize()
    ring = ring_for(dev)
    refused = ring.num_full
    with torch.cuda.stream(stream):  # the copies have run: the ring takes arrays again, segment after segment
        again = [ring.stage(a, stream) for a in arrays[: ring.num_segments]]  # ~11 segments, none of this loop's
    out[seed] = (all(torch.equal(g.cpu(), torch.from_numpy(a)) for g, a in zip(got, arrays)),
                 dst.tolist(), refused, all(t is not None for t in again), weakref.ref(ring))


def test_copies_behind_a_busy_stream_survive_the_ring_cycling() -> None:
    out: dict = {}
    threads = [threading.Thread(target=_cycle, args=(torch.cuda.Stream(), seed, out)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(100):  # a finished thread's locals are dropped as its state is torn down, around join()
        gc.collect()
        if all(out[seed][-1]() is None for seed in (1, 2)):
            break
        time.sleep(0.01)
    for seed in (1, 2):
        intact, flags, turned_away, reused, ring = out[seed]
        assert ring() is None  # the thread's ring (its pinned buffer) went with the thread
        assert intact and flags == [True, False, True] and reused
        assert turned_away > 0  # the ring did fill up behind the busy stream (and those copies pinned their own)
