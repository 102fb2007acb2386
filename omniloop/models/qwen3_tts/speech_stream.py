"""Stateful, batched streaming of the codec decoder.

Each open stream owns one *slot* in a pool: the state tensors of ``SpeechDecoder.state_specs`` with a
leading slot axis (positions, the sliding-window KV cache, every causal-conv tail). A batched ``decode``
gathers the slots of the requests in the call, runs one ``SpeechDecoder.step`` over chunks of different
lengths (right-padded), and scatters the new state back. Each code frame is therefore decoded exactly
once, and the concatenated chunks of a stream equal the one-shot decode of its codes.

The decoder is fully causal, so there is no lookahead: a chunk of n frames yields exactly n * 1920
final samples, nothing is held back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from omniloop.models.qwen3_tts.speech_decoder import SpeechDecoder


class CodecStreams:
    """Slot pool of per-request decoder state. Owned by one thread (the codec stage's runner)."""

    def __init__(self, decoder: SpeechDecoder, max_streams: int = 256, initial_slots: int = 8) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self.decoder = decoder
        self.max_streams = max_streams
        self.slot_of: dict[str, int] = {}
        self.num_frames_decoded = 0
        self.num_calls = 0
        self._pool = decoder.init_state(min(initial_slots, max_streams))
        self._free = list(range(self.capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self._pool[0].shape[0]

    @property
    def num_active(self) -> int:
        return len(self.slot_of)

    def state_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._pool)

    def open(self, req_id: str) -> None:
        """Start a stream at frame 0. Opening an id that is already open is an error."""
        if req_id in self.slot_of:
            raise KeyError(f"codec stream {req_id!r} is already open")
        if not self._free:
            self._grow()
        slot = self._free.pop()
        for t in self._pool:
            t[slot].zero_()
        self.slot_of[req_id] = slot

    def close(self, req_id: str) -> None:
        """Free a stream's slot on finish or abort; closing an unknown id does nothing (aborts race)."""
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def frames_done(self, req_id: str) -> int:
        return int(self._pool[0][self._slot(req_id)])

    @torch.inference_mode()
    def decode(self, chunks: Sequence[tuple[str, np.ndarray | Tensor]]) -> list[Tensor]:
        """Decode one chunk of codes ``[n, 16]`` for each open stream in ``chunks``, in one batched step.

        Returns float PCM tensors (``[n * 1920]``, on the decoder's device) in the order of ``chunks``.
        A request may appear at most once per call; ``n`` may be 0."""
        if not chunks:
            return []
        dec = self.decoder
        num_q = dec.cfg.num_quantizers
        device = self._pool[0].device
        slots, lens, tensors = [], [], []
        for req_id, codes in chunks:
            slots.append(self._slot(req_id))
            tensors.append(self._check_codes(req_id, codes, num_q, dec.cfg.codebook_size))
            lens.append(tensors[-1].shape[0])
        if len(set(slots)) != len(slots):
            raise ValueError("a codec stream appears more than once in one decode call")
        longest = max(lens)
        batch = torch.zeros((len(chunks), max(longest, 1), num_q), dtype=torch.int64)
        for row, t in enumerate(tensors):
            batch[row, :t.shape[0]] = t
        slot_idx = torch.tensor(slots, device=device)
        lens_t = torch.tensor(lens, device=device)
        state = [t.index_select(0, slot_idx) for t in self._pool]
        pcm, new_state = dec.step(batch.to(device), lens_t, state)
        for pool_t, new_t in zip(self._pool, new_state):
            pool_t.index_copy_(0, slot_idx, new_t)
        self.num_frames_decoded += sum(lens)
        self.num_calls += 1
        spf = dec.samples_per_frame
        pcm = pcm if pcm.dtype == torch.float64 else pcm.float()  # float32 out unless testing in f64
        return [pcm[row, :n * spf] for row, n in enumerate(lens)]

    def _slot(self, req_id: str) -> int:
        try:
            return self.slot_of[req_id]
        except KeyError:
            raise KeyError(f"codec stream {req_id!r} is not open (finished, aborted or never opened)") from None

    @staticmethod
    def _check_codes(req_id: str, codes: np.ndarray | Tensor, num_q: int, size: int) -> Tensor:
        t = torch.as_tensor(codes)
        if t.ndim != 2 or t.shape[1] != num_q:
            raise ValueError(f"codes for {req_id!r} must be [n, {num_q}], got {list(t.shape)}")
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"codes for {req_id!r} must be integers, got {t.dtype}")
        t = t.to(torch.int64)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= size):
            raise ValueError(f"codes for {req_id!r} must be in [0, {size}), got [{int(t.min())}, {int(t.max())}]")
        return t.cpu()

    def _grow(self) -> None:
        old = self.capacity
        if old >= self.max_streams:
            raise RuntimeError(f"codec stream capacity {self.max_streams} reached; close finished streams "
                               "or raise max_streams")
        new = min(2 * old, self.max_streams)
        extra = self.decoder.init_state(new - old)
        self._pool = [torch.cat([t, e]) for t, e in zip(self._pool, extra)]
        self._free = list(range(new - 1, old - 1, -1)) + self._free
