"""Per-slot device state of the talker stage, and the frame step that reads and advances it.

Everything a request needs between steps lives here, one row per slot, at a fixed address: the KV
cache, trailing text and code-0 history (``model.cache``), sampling parameters, the frame counter, and
the next decode input (the embedding of the frame it sampled last). Fixed addresses are what let a
CUDA graph replay the decode frame step without arguments, and keeping the next input on the device
is what lets the scheduler plan a request's next decode before the previous step's codes reach the host.

Rows of a decode batch are slots ``0..B-1`` (``rows=None``: views, no gathers); slots in that range
that are not decoding this step are masked by ``active``: their KV write lands on the scratch position
and none of their state changes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from omniloop.gpu.host_copy import to_device
from omniloop.models.qwen3_tts.generate import GREEDY
from omniloop.models.qwen3_tts.sampling import SamplingParams, sample_code0
from omniloop.models.qwen3_tts.talker import Qwen3TtsModel, TalkerCache


@dataclass
class TalkerState:
    model: Qwen3TtsModel
    cache: TalkerCache
    params: SamplingParams  # each field [S]
    step: torch.Tensor  # int64 [S]: frames this slot's request sampled so far
    next_input: torch.Tensor  # [S, H]: decode input built from the slot's last frame
    positions: torch.Tensor  # int64 [S]: decode inputs of the frame step (graph input buffer)
    active: torch.Tensor  # bool [S]: which of rows 0..B-1 decode this step (graph input buffer)
    # rows whose prompt was just prefilled: their first frame is sampled from ``pending_hidden`` (the
    # prefill's last hidden) inside the frame step, not from a decode, so it needs no eager code predictor
    fresh: torch.Tensor  # bool [S] (graph input buffer)
    pending_hidden: torch.Tensor  # [S, H]
    prompts: dict[int, torch.Tensor]  # slot -> prompt embeds [L, H], until its prefill is done

    @classmethod
    def allocate(cls, model: Qwen3TtsModel, num_slots: int, max_len: int, max_trailing: int) -> TalkerState:
        dev = model.device
        cache = model.allocate(num_slots, max_len, max_trailing)
        model.special_embeds()  # computed now: inside a graph capture it must already be cached
        params = SamplingParams.stack([dict(GREEDY, seed=0)] * num_slots, dev)
        return cls(model=model, cache=cache, params=params,
                   step=torch.zeros(num_slots, dtype=torch.int64, device=dev),
                   next_input=torch.zeros(num_slots, model.cfg.talker.decoder.hidden_size, dtype=model.dtype,
                                          device=dev),
                   positions=torch.full((num_slots,), max_len, dtype=torch.int64, device=dev),
                   active=torch.zeros(num_slots, dtype=torch.bool, device=dev),
                   fresh=torch.zeros(num_slots, dtype=torch.bool, device=dev),
                   pending_hidden=torch.zeros(num_slots, model.cfg.talker.decoder.hidden_size, dtype=model.dtype,
                                              device=dev),
                   prompts={})

    @property
    def num_slots(self) -> int:
        return self.step.shape[0]

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def reset(self, slot: int, embeds: torch.Tensor, trailing: torch.Tensor, sampling: dict, seed: int) -> None:
        """Start ``slot`` over for a new request (``reset_many`` of one)."""
        self.reset_many([slot], [embeds], [trailing], [sampling], [seed])

    def check_trailing(self, trailing: torch.Tensor) -> None:
        """A request's trailing text must fit its slot: growing would move the buffer captured graphs read."""
        if trailing.shape[0] > self.cache.trailing.shape[1]:
            raise ValueError(f"trailing text of {trailing.shape[0]} positions exceeds the runner's "
                             f"max_trailing={self.cache.trailing.shape[1]}")

    def reset_many(self, slots: list[int], embeds: list[torch.Tensor], trailing: list[torch.Tensor],
                   sampling: list[dict], seeds: list[int]) -> None:
        """Start ``slots`` over for new requests: trailing text, code-0 history, every sampling parameter and
        frame counter of all of them from one packed host-to-device copy, with one scatter per field (not one
        copy or fill per field per slot). No host sync: the copy is from pinned memory (``t[slot] = x`` would
        be a pageable copy, which waits for the step in flight)."""
        for t in trailing:
            self.check_trailing(t)
        cache = self.cache
        rows = [{**GREEDY, **s, "seed": seed} for s, seed in zip(sampling, seeds)]
        names = [f.name for f in fields(SamplingParams)]
        n = len(slots)
        lengths = np.asarray([t.shape[0] for t in trailing], dtype=np.int64)
        # one int64 block [slots | trailing lengths | every field as int64 or float32 bits], then the row of
        # every trailing position in the flattened trailing buffer; one copy
        host = np.empty((2 + len(names), n), dtype=np.int64)
        host[0] = slots
        host[1] = lengths
        for i, name in enumerate(names):
            dtype = getattr(self.params, name).dtype
            values = [r[name] for r in rows]
            if dtype.is_floating_point:
                host[2 + i] = np.asarray(values, dtype=np.float32).view(np.int32).astype(np.int64)
            else:
                host[2 + i] = np.asarray(values, dtype=np.int64)
        starts = np.repeat(np.asarray(slots, dtype=np.int64) * cache.trailing.shape[1], lengths)
        positions = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        dev = to_device(np.concatenate((host.reshape(-1), starts + positions)), self.step.device)
        block, trailing_rows = dev.split((host.size, starts.shape[0]))
        block = block.view(host.shape)
        index = block[0]
        text = torch.cat(trailing).to(cache.trailing.dtype)
        cache.trailing.view(-1, cache.trailing.shape[2]).index_copy_(0, trailing_rows, text)
        cache.trailing_len.index_copy_(0, index, block[1])
        cache.seen.index_fill_(0, index, False)
        for i, name in enumerate(names):
            field = getattr(self.params, name)
            col = block[2 + i]
            if field.dtype.is_floating_point:
                col = col.to(torch.int32).view(torch.float32)
            field.index_copy_(0, index, col.to(field.dtype))
        self.step.index_fill_(0, index, 0)
        for slot, e in zip(slots, embeds):
            self.prompts[slot] = e

    def frame_tail(self, hidden: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Sample one frame for each of rows (= slots) ``0..B-1`` from the talker's last hidden ``[B, H]`` and
        advance the state of the ``active`` rows. Returns codes ``[B, 16]``."""
        model, cache, b = self.model, self.cache, hidden.shape[0]
        params = SamplingParams(**{f.name: getattr(self.params, f.name)[:b] for f in fields(SamplingParams)})
        step = self.step[:b]
        logits = model.talker.codec_head(hidden)
        noise0, noise_sub = model.frame_noise(params, step)
        code0 = sample_code0(logits, params, cache.seen[:b], step, model.cfg.talker.codec_eos_id, noise0)
        rest = model.code_predictor.predict(hidden, model.codec_embed(code0), params, step, noise_sub)
        codes = torch.cat((code0[:, None], rest), dim=1)
        embeds = model.next_input(torch.arange(b, device=hidden.device), codes, step)
        seen = cache.seen[:b]
        mark = seen.gather(1, code0[:, None]) | active[:, None]
        seen.scatter_(1, code0[:, None], mark)
        self.next_input[:b] = torch.where(active[:, None], embeds.to(self.next_input.dtype), self.next_input[:b])
        self.step[:b] += active.to(torch.int64)
        return codes

    def decode_frame(self, b: int, kv_len: int) -> torch.Tensor:
        """The whole decode frame step for rows (= slots) ``0..b-1``: talker decode at ``positions[:b]``
        over keys ``[0, kv_len)``, then ``frame_tail``. Reads only fixed buffers: this is what gets captured.
        A ``fresh`` row (position = scratch, so its decode writes no real KV) takes ``pending_hidden`` instead
        of its decode output: its first frame after prefill."""
        positions, active = self.positions[:b], self.active[:b]
        x = self.next_input[:b, None]
        hidden = self.model.talker.model(x, positions[:, None], self.cache.k, self.cache.v, None, kv_len)[:, 0]
        hidden = torch.where(self.fresh[:b, None], self.pending_hidden[:b].to(hidden.dtype), hidden)
        return self.frame_tail(hidden, active)
