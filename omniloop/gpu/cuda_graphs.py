"""CUDA graphs of the talker's decode frame step, one per (batch bucket, kv-length bucket).

One replay runs the whole frame: talker decode for rows (= slots) ``0..B-1``, codec head, code-0
sampling, the 15-step code predictor with its sampling, and the next input embedding. Eager, that is
~1,500 kernel launches; PERF-NOTES measured graph replay 3-4x faster for these pieces.

The kv bucket bounds the keys decode attention reads, so its cost follows the batch's longest
context (rounded up to a bucket), not ``max_len``. All graphs share one memory pool and are captured
largest first, so smaller ones reuse the larger ones' intermediates; replays are serialized on one
stream, so sharing is safe.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
from collections.abc import Callable, Iterator

import torch

from omniloop.gpu.talker_state import TalkerState

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
SMALLEST_KV_BUCKET = 256


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    return tuple(b for b in BATCH_BUCKETS if b < max_num_seqs) + (max_num_seqs,)


def kv_buckets(max_len: int, smallest: int = SMALLEST_KV_BUCKET) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``max_len``, then ``max_len`` itself."""
    out, kv = [], smallest
    while kv < max_len:
        out.append(kv)
        kv *= 2
    return (*out, max_len)


def pick(buckets: tuple[int, ...], need: int) -> int:
    """The smallest bucket >= ``need``."""
    i = bisect.bisect_left(buckets, need)
    if i == len(buckets):
        raise ValueError(f"{need} exceeds the largest captured bucket {buckets[-1]}")
    return buckets[i]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The cyclic garbage collector held off (for the span of a graph capture). A collection that runs inside a
    capture (any allocation of Python objects may trigger one) can destroy a dead CUDA graph held in a
    reference cycle (the codec's step graphs and their streams were one, before the graphs held the streams
    weakly), and releasing that graph's memory pool while a stream captures invalidates the capture: the H200
    showed ``cudaErrorStreamCaptureInvalidated`` in a codec capture after earlier tests had dropped their
    streams, and not when that test ran alone."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def capture(fn: Callable[[], torch.Tensor], stream: torch.cuda.Stream, pool: tuple[int, int],
            upload: bool = False) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run ``fn`` once on ``stream`` (warm-up: lazy library init and cuDNN's algorithm choice must not happen
    inside a capture), then capture it into a graph on ``pool``, the collector held off; returns the graph and
    its output. Every CUDA graph of the project (talker frames, prefill, codec steps) is captured here.

    ``upload``: replay the graph once here (where running ``fn`` again changes nothing that matters, as for its
    warm-up run): a graph's first launch also uploads it to the device, host time that would otherwise fall on
    the first request that uses the bucket, typically in a burst's first admission plan. (torch has no
    ``cudaGraphUpload`` of its own.)"""
    with torch.cuda.stream(stream):
        fn()
    graph = torch.cuda.CUDAGraph()
    # thread_local: another stage placed as a thread of this process may use CUDA meanwhile
    with no_gc(), torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = fn()
    if upload:
        with torch.cuda.stream(stream):
            graph.replay()
    return graph, out


class FrameGraphs:
    """Captured ``TalkerState.decode_frame`` per (b, kv); ``replay`` runs on the current stream."""

    def __init__(self, state: TalkerState, stream: torch.cuda.Stream, batch: tuple[int, ...],
                 kv: tuple[int, ...]) -> None:
        self.batch, self.kv = batch, kv
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # with no row active, warm-up and capture change no slot state: KV writes land on the scratch position
        state.active.zero_()
        state.fresh.zero_()
        state.positions.fill_(state.max_len)
        with torch.no_grad():
            for b in sorted(batch, reverse=True):
                for kv_len in sorted(kv, reverse=True):
                    self._graphs[b, kv_len] = self._capture(state, stream, b, kv_len)

    def _capture(self, state: TalkerState, stream: torch.cuda.Stream, b: int,
                 kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        return capture(lambda: state.decode_frame(b, kv_len), stream, self._pool, upload=True)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def buckets_for(self, num_rows: int, kv_len: int) -> tuple[int, int]:
        return pick(self.batch, num_rows), pick(self.kv, kv_len)

    def replay(self, b: int, kv_len: int) -> torch.Tensor:
        """Replay bucket (b, kv_len) (see ``buckets_for``); returns its codes ``[b, 16]``, valid until the
        next replay of the same bucket."""
        graph, out = self._graphs[b, kv_len]
        graph.replay()
        return out
