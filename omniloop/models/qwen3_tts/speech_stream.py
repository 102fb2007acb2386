"""Stateful, batched streaming of the codec decoder.

Each open stream owns one *slot* in a pool: the state of ``SpeechDecoder.state_specs`` with a leading slot
axis, packed into three tensors (positions, every layer's sliding-window KV stacked, every causal-conv tail
flattened side by side), so one step gathers and scatters a batch's state in three ops each. A batched
``decode`` gathers the slots of the requests in the call, runs one ``SpeechDecoder.step`` over chunks of
different lengths (right-padded), and scatters the new state back. Each code frame is therefore decoded
exactly once, and the concatenated chunks of a stream equal the one-shot decode of its codes.

On CUDA the whole step (gather, decode, scatter) is captured as one CUDA graph per (batch bucket, frame
bucket): rows are padded to the bucket with ``lens == 0`` rows that read and write slot 0, a scratch slot
no stream owns, and frames past a row's ``lens`` are padding whose samples are never returned. The
convs' cuDNN algorithms are chosen in each graph's warm-up: with ``torch.backends.cudnn.benchmark`` on
(the codec stage sets it), that is a timed choice, once per shape.

The decoder is fully causal, so there is no lookahead: a chunk of n frames yields exactly n * 1920
final samples, nothing is held back.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from omniloop.gpu.cuda_graphs import batch_buckets, capture, pick
from omniloop.gpu.host_copy import to_device
from omniloop.models.qwen3_tts.speech_decoder import SpeechDecoder

FRAME_BUCKETS = (1, 2, 4, 8, 16, 25, 32)  # the codec scheduler's chunks: 1-2 first, doubling to 25
SCRATCH = 0  # pool row of padded batch rows; never a stream's slot


class _Pool:
    """The packed state of ``rows`` slots: ``pos [rows]``, ``kv [2 * layers, rows, heads, w, d]``,
    ``tails [rows, sum of tail sizes]``. Each tail ``[C, P]`` is packed in the decoder's layout (``[P, C]``
    when it is channels-last), so gather hands the layers views and scatter packs without a transpose. The KV
    is layer-major so each layer's gathered cache is contiguous: the transformer's concatenation of cache and
    new keys then takes torch's vectorized copy (strided, it took ~32 us a layer at 64 x 8 frames on an H200)."""

    SLOT_AXES = (0, 1, 0)  # the slot axis of pos, kv, tails

    def __init__(self, decoder: SpeechDecoder, rows: int) -> None:
        specs = decoder.state_specs()
        self.num_kv = 2 * decoder.cfg.num_hidden_layers
        self.tail_shapes = [shape for shape, _ in specs[1 + self.num_kv:]]
        self.channels_last = decoder.channels_last
        p = decoder.pre_conv.conv.weight
        self.pos = torch.zeros(rows, dtype=torch.int64, device=p.device)
        self.kv = torch.zeros((self.num_kv, rows, *specs[1][0]), dtype=p.dtype, device=p.device)
        self.tails = torch.zeros((rows, sum(math.prod(s) for s in self.tail_shapes)), dtype=p.dtype,
                                 device=p.device)

    @property
    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.pos, self.kv, self.tails

    def _kv_rows(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """The KV as ``[layers * rows, -1]`` and the rows of slots ``idx`` in it, layer-major: selecting along
        dim 0 takes torch's vectorized gather (along dim 1 it took the generic one, ~0.25 ms a 64-row step)."""
        rows = self.kv.shape[1]
        layers = torch.arange(self.num_kv, device=idx.device)
        return self.kv.view(self.num_kv * rows, -1), (layers[:, None] * rows + idx[None, :]).flatten()

    def gather(self, idx: Tensor) -> list[Tensor]:
        """The ``SpeechDecoder.step`` state of rows ``idx`` (views into three gathered tensors)."""
        table, rows = self._kv_rows(idx)
        pos, flat = self.pos.index_select(0, idx), self.tails.index_select(0, idx)
        kv = table.index_select(0, rows).view(self.num_kv, idx.shape[0], *self.kv.shape[2:])
        tails, off = [], 0
        for c, p in self.tail_shapes:
            part = flat.narrow(1, off, c * p)
            tails.append(part.view(-1, p, c).transpose(1, 2) if self.channels_last else part.view(-1, c, p))
            off += c * p
        return [pos, *kv.unbind(0), *tails]

    def scatter(self, idx: Tensor, state: list[Tensor]) -> None:
        kv = torch.stack(state[1:1 + self.num_kv], dim=0)
        tails = state[1 + self.num_kv:]
        flat = torch.cat([(t.transpose(1, 2) if self.channels_last else t).flatten(1) for t in tails], dim=1)
        table, rows = self._kv_rows(idx)
        table.index_copy_(0, rows, kv.view(rows.shape[0], -1))
        self.pos.index_copy_(0, idx, state[0])
        self.tails.index_copy_(0, idx, flat)

    def slot(self, slot: int) -> tuple[Tensor, Tensor, Tensor]:
        """Views of one slot's state in the three tensors."""
        return tuple(t.select(axis, slot) for t, axis in zip(self.tensors, self.SLOT_AXES))

    def grown(self, decoder: SpeechDecoder, rows: int) -> _Pool:
        new = _Pool(decoder, rows)
        for dst, src, axis in zip(new.tensors, self.tensors, self.SLOT_AXES):
            dst.narrow(axis, 0, src.shape[axis]).copy_(src)
        return new


class CodecStreams:
    """Slot pool of per-request decoder state. Owned by one thread (the codec stage's runner).

    ``graphs``: replay CUDA graphs of the step (default: on when the decoder is on CUDA)."""

    def __init__(self, decoder: SpeechDecoder, max_streams: int = 256, initial_slots: int = 8,
                 graphs: bool | None = None) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self.decoder = decoder
        self.max_streams = max_streams
        self.slot_of: dict[str, int] = {}
        self.num_frames_decoded = 0
        self.num_calls = 0
        self._pool = _Pool(decoder, 1 + min(initial_slots, max_streams))
        self._free = list(range(self.capacity, SCRATCH, -1))
        self.device = self._pool.pos.device
        use_graphs = self.device.type == "cuda" if graphs is None else graphs
        self._graphs = _StepGraphs(self, batch_buckets(max_streams)) if use_graphs else None

    @property
    def capacity(self) -> int:
        return self._pool.pos.shape[0] - 1

    @property
    def num_active(self) -> int:
        return len(self.slot_of)

    @property
    def num_graphs(self) -> int:
        return 0 if self._graphs is None else len(self._graphs.graphs)

    def state_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._pool.tensors)

    def open(self, req_id: str) -> None:
        """Start a stream at frame 0. Opening an id that is already open is an error."""
        if req_id in self.slot_of:
            raise KeyError(f"codec stream {req_id!r} is already open")
        if not self._free:
            self._grow()
        slot = self._free.pop()
        for t in self._pool.slot(slot):
            t.zero_()
        self.slot_of[req_id] = slot

    def close(self, req_id: str) -> None:
        """Free a stream's slot on finish or abort; closing an unknown id does nothing (aborts race)."""
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def frames_done(self, req_id: str) -> int:
        return int(self._pool.pos[self._slot(req_id)])

    @torch.inference_mode()
    def decode(self, chunks: Sequence[tuple[str, np.ndarray | Tensor]]) -> list[Tensor]:
        """Decode one chunk of codes ``[n, 16]`` for each open stream in ``chunks``, in one batched step.

        Returns float PCM tensors (``[n * 1920]``, on the decoder's device; on CUDA valid until the next
        call) in the order of ``chunks``. A request may appear at most once per call; ``n`` may be 0."""
        if not chunks:
            return []
        lens = [int(np.shape(codes)[0]) if np.ndim(codes) else 0 for _, codes in chunks]
        pcm = self._step(chunks, lens)
        spf = self.decoder.samples_per_frame
        return [pcm[row, :n * spf] for row, n in enumerate(lens)]

    @torch.inference_mode()
    def decode_host(self, chunks: Sequence[tuple[str, np.ndarray | Tensor]]) -> list[np.ndarray]:
        """``decode`` with the PCM on the host (numpy views; float32, or float64 for a float64 decoder).

        With graphs, chunks are grouped by frame bucket and each group is one replay, so a step that mixes a
        25-frame chunk with many 1-frame first chunks does not pad every row to 25 frames. Each group's PCM
        is copied into pinned memory before the next replay reuses the graphs' memory; one wait at the end."""
        if not chunks:
            return []
        lens = [int(np.shape(codes)[0]) if np.ndim(codes) else 0 for _, codes in chunks]
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lens):
            groups.setdefault(self._graphs.bucket(1, max(n, 1))[1] if self._graphs is not None else 0, []).append(i)
        batches = []
        for frames, rows in sorted(groups.items()):
            # after warm-up, a group too large for any captured graph is split into captured ones: capturing a
            # new shape mid-serving stalls the stage for hundreds of ms (cuDNN timing, capture)
            most = self._graphs.max_rows(frames) if self._graphs is not None else 0
            batches += [rows[i:i + most] for i in range(0, len(rows), most)] if most else [rows]
        copies: list[tuple[list[int], Tensor]] = []
        for rows in batches:
            pcm = self._step([chunks[i] for i in rows], [lens[i] for i in rows])[:len(rows)]
            if pcm.device.type != "cpu":
                host = torch.empty(pcm.shape, dtype=pcm.dtype, pin_memory=True)
                host.copy_(pcm, non_blocking=True)
                pcm = host
            copies.append((rows, pcm))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        spf = self.decoder.samples_per_frame
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(chunks)
        for rows, pcm in copies:
            arr = pcm.numpy()
            for row, i in enumerate(rows):
                out[i] = arr[row, :lens[i] * spf]
        return out

    def _step(self, chunks: Sequence[tuple[str, np.ndarray | Tensor]], lens: list[int]) -> Tensor:
        """Run one batched step; returns PCM ``[>= len(chunks), >= max(lens) * 1920]`` on the device."""
        cfg = self.decoder.cfg
        longest = max(max(lens), 1)
        graphs = self._graphs
        bucket = graphs.bucket(len(chunks), longest) if graphs is not None else None
        rows, frames = bucket or (len(chunks), longest)
        # codes, lens and slots travel in one int64 buffer: one host-to-device copy per step
        buf = np.zeros(rows * frames * cfg.num_quantizers + 2 * rows, dtype=np.int64)
        codes = buf[:rows * frames * cfg.num_quantizers].reshape(rows, frames, cfg.num_quantizers)
        meta = buf[rows * frames * cfg.num_quantizers:].reshape(2, rows)
        seen = set()
        for row, ((req_id, chunk), n) in enumerate(zip(chunks, lens)):
            slot = self._slot(req_id)
            if slot in seen:
                raise ValueError("a codec stream appears more than once in one decode call")
            seen.add(slot)
            codes[row, :n] = self._check_codes(req_id, chunk, cfg.num_quantizers, cfg.codebook_size)
            meta[:, row] = n, slot
        self.num_frames_decoded += sum(lens)
        self.num_calls += 1
        if graphs is not None:
            return graphs.replay(bucket, buf)
        return self._run(*self._split(to_device(buf, self.device), rows, frames))

    def _split(self, buf: Tensor, rows: int, frames: int) -> tuple[Tensor, Tensor, Tensor]:
        n = rows * frames * self.decoder.cfg.num_quantizers
        codes = buf[:n].view(rows, frames, -1)
        return codes, buf[n:n + rows], buf[n + rows:]

    def _run(self, codes: Tensor, lens: Tensor, slots: Tensor) -> Tensor:
        """Gather, decode, scatter: the body of a step (captured as is in a graph)."""
        pcm, state = self.decoder.step(codes, lens, self._pool.gather(slots))
        self._pool.scatter(slots, state)
        return pcm if pcm.dtype == torch.float64 else pcm.float()  # float32 out unless testing in f64

    def _slot(self, req_id: str) -> int:
        try:
            return self.slot_of[req_id]
        except KeyError:
            raise KeyError(f"codec stream {req_id!r} is not open (finished, aborted or never opened)") from None

    @staticmethod
    def _check_codes(req_id: str, codes: np.ndarray | Tensor, num_q: int, size: int) -> np.ndarray:
        a = codes.numpy(force=True) if isinstance(codes, Tensor) else np.asarray(codes)
        if a.ndim != 2 or a.shape[1] != num_q:
            raise ValueError(f"codes for {req_id!r} must be [n, {num_q}], got {list(a.shape)}")
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"codes for {req_id!r} must be integers, got {a.dtype}")
        if a.size and (a.min() < 0 or a.max() >= size):
            raise ValueError(f"codes for {req_id!r} must be in [0, {size}), got [{a.min()}, {a.max()}]")
        return a

    def warmup(self, max_rows_x_frames: int = 256, max_frames: int = FRAME_BUCKETS[-1],
               check: Callable[[int], None] | None = None) -> int:
        """Capture the step graphs of chunks up to ``max_frames`` (the scheduler's largest chunk) up front
        (CUDA); returns how many exist. Without it, each bucket is captured the first time a step needs it,
        stalling that step. ``check(num_graphs)`` runs after each capture (a memory budget raises there)."""
        if self._graphs is None:
            return 0
        return self._graphs.capture_all(max_rows_x_frames, max_frames, check)

    def _grow(self) -> None:
        old = self.capacity
        if old >= self.max_streams:
            raise RuntimeError(f"codec stream capacity {self.max_streams} reached; close finished streams "
                               "or raise max_streams")
        new = min(2 * old, self.max_streams)
        self._pool = self._pool.grown(self.decoder, 1 + new)
        self._free = list(range(new, old, -1)) + self._free
        if self._graphs is not None:
            self._graphs.clear()  # captured against the old pool's addresses


class _StepGraphs:
    """``CodecStreams._run`` captured per (rows, frames) bucket, lazily on first use (longer chunks: eager,
    padded). All graphs share
    one memory pool; replays are serialized on the owner thread's stream, and a replay's PCM is read
    (copied out) before the next replay, so sharing is safe."""

    def __init__(self, streams: CodecStreams, batch: tuple[int, ...]) -> None:
        # a weak reference: the streams own these graphs, and a cycle between them would leave dropped streams'
        # graphs (and their memory pool) to the cyclic collector, which may run inside another capture
        self.streams, self.batch = weakref.proxy(streams), batch
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor, Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        # one side stream for every warm-up and capture: the caching allocator keeps freed blocks per stream, so
        # a fresh stream per capture would strand each warm-up's activations in a cache no other stream reuses
        self._stream = torch.cuda.Stream(streams.device)
        self.limit = 0  # rows * frames captured up front by ``capture_all`` (0: none, capture on first use)

    def bucket(self, num_rows: int, frames: int) -> tuple[int, int]:
        """The padded shape of a step. Chunks longer than the largest frame bucket (a clone's reference
        frames) run eagerly, rounded up to a multiple of it: few distinct shapes, so each conv's cuDNN
        algorithm is chosen once per shape, not once per request."""
        top = FRAME_BUCKETS[-1]
        frames = pick(FRAME_BUCKETS, frames) if frames <= top else -(-frames // top) * top
        return pick(self.batch, num_rows), frames

    def clear(self) -> None:
        self.graphs.clear()
        self.limit = 0

    def capture_all(self, max_rows_x_frames: int, max_frames: int = FRAME_BUCKETS[-1],
                    check: Callable[[int], None] | None = None) -> int:
        """Capture the (batch, frames) buckets up to ``rows * frames <= max_rows_x_frames`` now, so steps never
        stall on a capture while serving: ``decode_host`` splits a larger group into captured replays."""
        # largest first: the graphs share one memory pool, and smaller captures can then reuse (split) the
        # blocks a larger one freed. Captured smallest first, 47 graphs of the 1.7B decoder reserved 56 GiB
        # on the H200; the effect of this order there is not measured yet.
        top = pick(FRAME_BUCKETS, min(max_frames, FRAME_BUCKETS[-1]))
        shapes = [(r, f) for r in self.batch for f in FRAME_BUCKETS if r * f <= max_rows_x_frames and f <= top]
        for rows, frames in sorted(shapes, key=lambda rf: (rf[0] * rf[1], rf), reverse=True):
            if (rows, frames) not in self.graphs:
                self.graphs[(rows, frames)] = self._capture(rows, frames)
                if check is not None:
                    check(len(self.graphs))
        self.limit = max(self.limit, max_rows_x_frames)
        return len(self.graphs)

    def max_rows(self, frames: int) -> int:
        """The most rows one replay of frame bucket ``frames`` may take without a new capture (0: no limit,
        nothing was captured up front, or no captured graph has that many frames: ``replay`` runs it eagerly)."""
        if not self.limit or frames > FRAME_BUCKETS[-1]:
            return 0
        return max((r for r in self.batch if (r, frames) in self.graphs), default=0)

    def replay(self, bucket: tuple[int, int], host: np.ndarray) -> Tensor:
        """Copy the step's inputs in (one pinned copy), replay; the PCM is valid until the next step."""
        s = self.streams
        # after ``capture_all``, a shape it did not capture (a frame bucket above the scheduler's largest chunk:
        # a clone's first chunk carries its reference frames) runs eagerly: no capture while serving
        if bucket[1] > FRAME_BUCKETS[-1] or (self.limit and bucket not in self.graphs):
            return s._run(*s._split(to_device(host, s.device), *bucket))
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(*bucket)
        graph, inp, out = self.graphs[bucket]
        to_device(host, s.device, out=inp)
        graph.replay()
        return out

    def _capture(self, rows: int, frames: int) -> tuple[torch.cuda.CUDAGraph, Tensor, Tensor]:
        s = self.streams
        # all rows on the scratch slot with lens 0: warm-up and capture leave every stream's state as it is
        inp = torch.zeros(rows * frames * s.decoder.cfg.num_quantizers + 2 * rows, dtype=torch.int64,
                          device=s.device)
        args = s._split(inp, rows, frames)
        self._stream.wait_stream(torch.cuda.current_stream(s.device))  # the zeros above first
        graph, out = capture(lambda: s._run(*args), self._stream, self._pool)
        torch.cuda.current_stream(s.device).wait_stream(self._stream)
        return graph, inp, out
