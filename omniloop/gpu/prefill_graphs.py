"""CUDA graphs of the talker's batched prefill forward, one per (rows, tokens) bucket.

Eager, a prefill plan launches ~25 kernels per layer from Python: on the H200 that kept the talker's
loop thread busy 35-120 ms per admission plan (the GPU work itself is a fraction of it), and no decode
step could be submitted meanwhile (benchmarks/pipeline.md). Replaying a captured forward costs the
host one launch.

A graph takes pieces that start at position 0 (whole prompts, or the first piece of a long one),
right-padded to ``tokens`` positions in ``rows`` rows. Since every piece starts at 0, each token attends
the call's own keys causally (``prefix``: flash attention, no mask, no gather of the slot's cache; the keys
and values are also written to each row's slot), and a real token never sees the padding after it. Padding
tokens and padding rows write their K/V on the scratch position (``max_len``) of slot 0 and their outputs
are ignored. Pieces that start later (the rest of a chunked prompt) run eagerly. All graphs share one memory
pool and one input buffer and are captured largest first; replays are serialized on the runner's stream.

``PackedPrefillGraphs`` lays the pieces end to end instead (one graph per total-token bucket). Both offer
``bucket(lens)`` and ``run(bucket, pieces, slots) -> (hidden, last)``, ``last`` the (row, column) of each
piece's last token in ``hidden``, so the runner uses either without knowing which.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from omniloop.gpu.cuda_graphs import capture
from omniloop.gpu.host_copy import to_device
from omniloop.gpu.talker_state import TalkerState

ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 20, 24, 32, 48, 64)
TOKEN_BUCKETS = (32, 64, 128, 192, 256, 320, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
MAX_AREA = 8192  # rows x tokens of the largest graph (twice the profile's 4096-token step budget)
# Packed prompts instead (``PackedPrefillGraphs``): one graph per total-token bucket, no row padding and no
# per-row token padding (H200, 1.7B, an 18 x 218-token admission plan: 28.6 -> 27.0 ms, CUDA time 27.3 -> 23.6 ms;
# first-audio p95 at 64 streams 0.166 -> 0.155 s; benchmarks/pipeline.md). ``OMNILOOP_PACKED_PREFILL=0`` turns
# it off for a run (the padded (rows x tokens) graphs)
PACKED = os.environ.get("OMNILOOP_PACKED_PREFILL") != "0"
PACKED_BUCKETS = (64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 8192)


def check_token_buckets(buckets: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Prompt-length buckets as given by a profile (``prefill_token_buckets``): positive, strictly increasing.
    Finer buckets pad less (19 prompts of 215 tokens run as 20 x 256 with the defaults) at the cost of more
    graphs captured at start."""
    buckets = tuple(int(b) for b in buckets)
    if not buckets or buckets[0] < 1 or any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"prefill token buckets must be positive and strictly increasing, got {list(buckets)}")
    return buckets


class _CapturedPrefill:
    """What both prefill graph sets share: one memory pool, a graph per shape captured largest first (after the
    subclass made the input buffers ``_forward`` reads), replays on the runner's stream."""

    def __init__(self, state: TalkerState, stream: torch.cuda.Stream, shapes: list) -> None:
        self.state = state
        self.shapes = shapes
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict = {}
        with torch.no_grad():
            for shape in shapes:
                # every position is the scratch one here: warm-up, capture and upload write no slot's real KV
                self._graphs[shape] = capture(lambda shape=shape: self._forward(shape), stream, self._pool,
                                              upload=True)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _forward(self, shape) -> torch.Tensor:  # noqa: ANN001
        raise NotImplementedError

    def _replay(self, shape) -> torch.Tensor:  # noqa: ANN001
        graph, out = self._graphs[shape]
        graph.replay()
        return out


class PrefillGraphs(_CapturedPrefill):
    def __init__(self, state: TalkerState, stream: torch.cuda.Stream, max_rows: int,
                 max_area: int = MAX_AREA, token_buckets: tuple[int, ...] = TOKEN_BUCKETS) -> None:
        model = state.model
        hidden = model.cfg.talker.decoder.hidden_size
        dev = state.step.device
        tokens = tuple(t for t in check_token_buckets(token_buckets) if t <= state.max_len)
        rows = tuple(r for r in ROW_BUCKETS if r < max_rows) + (max_rows,)
        shapes = sorted(((r, t) for r in rows for t in tokens if r * t <= max_area),
                        key=lambda rt: (rt[0] * rt[1], rt), reverse=True)
        area = max((r * t for r, t in shapes), default=0)
        self._x = torch.zeros(area, hidden, dtype=model.dtype, device=dev)
        self._pos = torch.full((area,), state.max_len, dtype=torch.int64, device=dev)
        self._slots = torch.zeros(max(rows, default=1), dtype=torch.int64, device=dev)
        super().__init__(state, stream, shapes)

    def _forward(self, shape: tuple[int, int]) -> torch.Tensor:
        s, (rows, tokens) = self.state, shape
        x = self._x[:rows * tokens].view(rows, tokens, -1)
        pos = self._pos[:rows * tokens].view(rows, tokens)
        return s.model.talker.model(x, pos, s.cache.k, s.cache.v, self._slots[:rows], tokens, prefix=True)

    def bucket(self, lens: list[int]) -> tuple[int, int] | None:
        """The captured shape of least area that holds pieces of ``lens`` tokens, one a row (None: none does;
        run eagerly)."""
        fits = [(r * t, r, t) for r, t in self._graphs if r >= len(lens) and t >= max(lens)]
        return min(fits)[1:] if fits else None

    def run(self, bucket: tuple[int, int], pieces: list[torch.Tensor],
            starts_zero_slots: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Prefill ``pieces`` (prompt embeds ``[n_i, H]`` from position 0) of slots ``starts_zero_slots`` in
        bucket ``bucket``; returns the hidden states ``[rows, tokens, H]`` (row i = piece i), valid until
        the next replay, and each piece's last token ``[2, n]`` (its row, its column)."""
        rows, tokens = bucket
        lens = np.array([p.shape[0] for p in pieces], dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(lens)[:-1]))
        total = int(lens.sum())
        # one pinned host buffer: positions of the padded layout, the rows' slots, each token's padded row
        host = np.empty(rows * tokens + rows + total, dtype=np.int64)
        pos = host[:rows * tokens].reshape(rows, tokens)
        pos.fill(self.state.max_len)
        col = np.arange(tokens, dtype=np.int64)
        valid = col[None, :] < lens[:, None]
        pos[:len(pieces)][valid] = np.broadcast_to(col, (len(pieces), tokens))[valid]
        slots = host[rows * tokens:rows * tokens + rows]
        slots.fill(0)
        slots[:len(pieces)] = starts_zero_slots
        dest = host[rows * tokens + rows:]
        dest[:] = np.repeat(np.arange(len(pieces), dtype=np.int64) * tokens - offsets, lens) + np.arange(total)
        dev = to_device(host, self._pos.device)
        self._pos[:rows * tokens].copy_(dev[:rows * tokens])
        self._slots[:rows].copy_(dev[rows * tokens:rows * tokens + rows])
        self._x.index_copy_(0, dev[rows * tokens + rows:], torch.cat(pieces).to(self._x.dtype))
        return self._replay(bucket), np.stack((np.arange(len(pieces)), lens - 1))


class PackedPrefillGraphs(_CapturedPrefill):
    """The prefill of whole prompts laid end to end (``DecoderStack.forward(..., seq_start=...)``): one graph
    per total-token bucket, so 18 prompts of 218 tokens run as 3,924 tokens padded to 4,096 instead of
    20 x 256 = 5,120. Each token is a row with its own slot and position; token t attends its prompt's keys
    up to itself (``gpu/kernels/packed_attention.py``). Padding tokens are one-token prompts of their own
    on the scratch position of slot 0, their outputs ignored."""

    def __init__(self, state: TalkerState, stream: torch.cuda.Stream, max_tokens: int = MAX_AREA,
                 buckets: tuple[int, ...] = PACKED_BUCKETS) -> None:
        model = state.model
        dev = state.step.device
        shapes = sorted((t for t in buckets if t <= max_tokens), reverse=True)
        top = max(shapes, default=0)
        self._x = torch.zeros(top, model.cfg.talker.decoder.hidden_size, dtype=model.dtype, device=dev)
        self._pos = torch.full((top, 1), state.max_len, dtype=torch.int64, device=dev)
        self._slots = torch.zeros(top, dtype=torch.int64, device=dev)
        self._start = torch.arange(top, dtype=torch.int64, device=dev)
        super().__init__(state, stream, shapes)

    def _forward(self, tokens: int) -> torch.Tensor:
        s = self.state
        return s.model.talker.model(self._x[:tokens, None], self._pos[:tokens], s.cache.k, s.cache.v,
                                    self._slots[:tokens], 1, prefix=True, seq_start=self._start[:tokens])

    def bucket(self, lens: list[int]) -> int | None:
        """The smallest captured token count that holds pieces of ``lens`` tokens end to end (None: none does;
        run eagerly)."""
        fits = [t for t in self._graphs if t >= sum(lens)]
        return min(fits) if fits else None

    def run(self, bucket: int, pieces: list[torch.Tensor], slots: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Prefill ``pieces`` (prompt embeds ``[n_i, H]`` from position 0) of ``slots`` in the ``bucket``-token
        graph; returns the hidden states ``[bucket, 1, H]`` (valid until the next replay) and each piece's last
        token ``[2, n]`` (its row, column 0)."""
        host, last = packed_layout(np.array([p.shape[0] for p in pieces], dtype=np.int64), slots, bucket,
                                   self.state.max_len)
        dev = to_device(host, self._pos.device)  # one pinned copy
        self._pos[:bucket, 0].copy_(dev[0])
        self._slots[:bucket].copy_(dev[1])
        self._start[:bucket].copy_(dev[2])
        self._x[:int(last[-1]) + 1].copy_(torch.cat(pieces).to(self._x.dtype))
        return self._replay(bucket), np.stack((last, np.zeros_like(last)))


def build_prefill_graphs(state: TalkerState, stream: torch.cuda.Stream | None, max_rows: int,
                         token_buckets: tuple[int, ...] | None = None) -> PrefillGraphs | PackedPrefillGraphs:
    """The runner's prefill graphs: packed prompts (``PACKED``, the default), or the padded (rows x tokens)
    graphs when ``PACKED`` is off or the stage names per-prompt ``token_buckets`` (its
    ``prefill_token_buckets`` option), which only the padded graphs have: a tuned bucket list is never ignored."""
    if PACKED and token_buckets is None:
        return PackedPrefillGraphs(state, stream)
    return PrefillGraphs(state, stream, max_rows=max_rows, token_buckets=token_buckets or TOKEN_BUCKETS)


def packed_layout(lens: np.ndarray, slots: np.ndarray, bucket: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of ``lens`` tokens (slots ``slots``) laid end to end in ``bucket`` token rows: ``[3, bucket]``
    of each token's position (from 0 in its prompt), slot and prompt start, padding tokens on the scratch
    position ``max_len`` of slot 0, each its own prompt; and the row of each prompt's last token."""
    offsets = np.concatenate(([0], np.cumsum(lens)[:-1]))
    total = int(lens.sum())
    if total > bucket or len(slots) != len(lens) or (lens < 1).any():
        raise ValueError(f"{len(lens)} prompts of {total} tokens (slots {len(slots)}) do not fit {bucket} rows")
    host = np.empty((3, bucket), dtype=np.int64)
    host[0, :total] = np.arange(total) - np.repeat(offsets, lens)
    host[0, total:] = max_len
    host[1, :total] = np.repeat(slots, lens)
    host[1, total:] = 0
    host[2, :total] = np.repeat(offsets, lens)
    host[2, total:] = np.arange(total, bucket)
    return host, offsets + lens - 1
