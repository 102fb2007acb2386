"""The Qwen3-TTS talker stage model: talker decoder + code predictor over a slot KV cache.

Step API used by ``generate`` and by the engine runner (all batched; ``slots`` is an int64 ``[B]``
tensor of cache slots, one per request):

* ``allocate(num_slots, max_len)`` — KV cache ``[layers, slots, kv_heads, max_len + 1, head_dim]`` plus
  per-slot trailing-text buffers and code-0 history.
* ``prefill(slots, embeds, starts=None) -> hidden [B, H]`` — variable-length prompts (``[L_i, H]`` each,
  from ``prompt.build_prompts``) right-padded into one forward; returns each prompt's last normed hidden.
  ``starts`` continues a chunked prefill at those positions.
* ``set_trailing(slot, trailing)`` — the text embeddings to add on later decode steps (admission time).
* ``sample_frame(slots, hidden, params, step) -> codes [B, 16]`` — codebook 0 from ``codec_head`` with
  the talker rules, then codebooks 1..15 from the code predictor. ``step`` = frame index per row.
* ``next_input(slots, codes, step) -> embeds [B, H]`` — sum of the 16 code embeddings plus trailing text
  ``step`` (or ``tts_pad`` once the text is used up), built on the device.
* ``decode_step(slots, embeds, positions, kv_len=None) -> hidden [B, H]`` — one token per row at its own
  position; ``kv_len=None`` attends over the whole static cache length (CUDA-graph friendly).

Frame ``k`` of a request: ``codes_k = sample_frame(h_k)``; stop if ``codes_k[0]`` is EOS; otherwise
``h_{k+1} = decode_step(next_input(codes_k, k), position = prompt_len + k)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.qwen3_tts.code_predictor import CodePredictor
from omniloop.models.qwen3_tts.config import TtsConfig
from omniloop.models.qwen3_tts.fused_weights import fuse, is_fused
from omniloop.models.qwen3_tts.layers import DecoderStack
from omniloop.models.qwen3_tts.sampling import SamplingParams, frame_noise, sample_code0


class TextProjection(nn.Module):
    def __init__(self, text_hidden: int, hidden: int, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True, device=device, dtype=dtype)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    def __init__(self, cfg: TtsConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        tc, dec = cfg.talker, cfg.talker.decoder
        kw = dict(device=device, dtype=dtype)
        self.model = DecoderStack(dec, device, dtype)
        self.codec_embedding = nn.Embedding(dec.vocab_size, dec.hidden_size, **kw)
        self.text_embedding = nn.Embedding(tc.text_vocab_size, tc.text_hidden_size, **kw)
        self.text_projection = TextProjection(tc.text_hidden_size, dec.hidden_size, device, dtype)
        self.codec_head = nn.Linear(dec.hidden_size, dec.vocab_size, bias=False, **kw)


@dataclass
class TalkerCache:
    k: torch.Tensor  # [layers, slots, kv_heads, max_len + 1, head_dim]; the last position is scratch
    v: torch.Tensor
    trailing: torch.Tensor  # [slots, max_trailing, H]
    trailing_len: torch.Tensor  # [slots] int64
    seen: torch.Tensor  # [slots, codec_vocab] bool: code-0 tokens already produced (repetition penalty)

    @property
    def max_len(self) -> int:
        return self.k.shape[3] - 1


class Qwen3TtsModel(nn.Module):
    def __init__(self, cfg: TtsConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.talker = Talker(cfg, device, dtype)
        self.code_predictor = CodePredictor(cfg.talker, device, dtype)
        self.cache: TalkerCache | None = None
        self._special: tuple[tuple, torch.Tensor] | None = None
        self._frame_table: torch.Tensor | None = None  # set by fuse_projections: the 16 codec tables as one
        self._frame_offsets: torch.Tensor | None = None  # [16] first row of each codebook's table in it

    @property
    def device(self) -> torch.device:
        return self.talker.codec_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.talker.codec_head.weight.dtype

    # ----------------------------------------------------------------------------- embeddings
    def text_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """T(ids) = text_projection(text_embedding(ids))."""
        return self.talker.text_projection(self.talker.text_embedding(ids.to(self.device)))

    def codec_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.talker.codec_embedding(ids.to(self.device))

    def special_embeds(self) -> torch.Tensor:
        """``[3, H]``: T(tts_bos), T(tts_eos), T(tts_pad); recomputed only when those weights change."""
        params = (self.talker.text_embedding.weight, *self.talker.text_projection.parameters())
        key = tuple((id(p), p._version, p.data_ptr()) for p in params)
        if self._special is None or self._special[0] != key:
            ids = torch.tensor([self.cfg.tts_bos_id, self.cfg.tts_eos_id, self.cfg.tts_pad_id])
            with torch.no_grad():
                self._special = (key, self.text_embed(ids))
        return self._special[1]

    def fuse_projections(self) -> None:
        """Fused QKV and gate/up weights in the talker and code predictor (CUDA: fewer, larger matmuls); the
        16 codec embedding tables as views of one table (a frame's input: one gather, not sixteen); the code
        predictor's projected input table. Idempotent; parameters stay in place as views, so loading and
        ``module_bytes`` see the same tensors."""
        for stack in (self.talker.model, self.code_predictor.model):
            if not stack.is_fused():
                stack.fuse()  # first time, or some of its parameters were replaced (moved, reloaded) since
        tables = self._frame_tables()
        same = len({(t.dtype, t.device) for t in tables}) == 1  # else one table would cast some of them
        if same and not is_fused(self._frame_table, *tables):
            self._frame_table = fuse(list(tables))
            sizes = [t.shape[0] for t in tables]
            self._frame_offsets = torch.tensor([sum(sizes[:g]) for g in range(len(sizes))], device=self.device)
        if not self.code_predictor.inputs_fused():
            self.code_predictor.fuse_inputs()

    def _frame_tables(self) -> tuple[nn.Parameter, ...]:
        return (self.talker.codec_embedding.weight, *(e.weight for e in self.code_predictor.codec_embedding))

    # ----------------------------------------------------------------------------- cache
    def allocate(self, num_slots: int, max_len: int, max_trailing: int = 256) -> TalkerCache:
        dec = self.cfg.talker.decoder
        shape = (dec.num_layers, num_slots, dec.num_kv_heads, max_len + 1, dec.head_dim)
        kw = dict(device=self.device, dtype=self.dtype)
        self.cache = TalkerCache(
            k=torch.zeros(shape, **kw), v=torch.zeros(shape, **kw),
            trailing=torch.zeros(num_slots, max_trailing, dec.hidden_size, **kw),
            trailing_len=torch.zeros(num_slots, dtype=torch.int64, device=self.device),
            seen=torch.zeros(num_slots, dec.vocab_size, dtype=torch.bool, device=self.device))
        return self.cache

    def _require_cache(self) -> TalkerCache:
        if self.cache is None:
            raise RuntimeError("Qwen3TtsModel.allocate(num_slots, max_len) must be called before stepping")
        return self.cache

    def set_trailing(self, slot: int, trailing: torch.Tensor) -> None:
        """Install a request's trailing text ``[n, H]`` in its slot and clear its code-0 history."""
        cache = self._require_cache()
        n = trailing.shape[0]
        if n > cache.trailing.shape[1]:  # grows only at admission, never inside a step
            grown = torch.zeros(cache.trailing.shape[0], n, cache.trailing.shape[2], dtype=self.dtype,
                                device=self.device)
            grown[:, : cache.trailing.shape[1]] = cache.trailing
            cache.trailing = grown
        cache.trailing[slot, :n] = trailing.to(self.dtype)
        # slice fills, not ``t[slot] = n``: a scalar assigned into a device element is a pageable copy that
        # waits for everything queued on the stream (the step in flight)
        cache.trailing_len[slot:slot + 1].fill_(n)
        cache.seen[slot].fill_(False)

    # ----------------------------------------------------------------------------- steps
    @torch.no_grad()
    def prefill(self, slots: torch.Tensor, embeds: list[torch.Tensor], starts: list[int] | None = None) -> torch.Tensor:
        cache = self._require_cache()
        lengths = [e.shape[0] for e in embeds]
        starts = starts or [0] * len(embeds)
        for i, (s, n) in enumerate(zip(starts, lengths)):
            if s + n > cache.max_len:
                raise ValueError(f"prompt {i}: positions up to {s + n} exceed the KV cache length {cache.max_len}")
        longest = max(lengths)
        x = torch.zeros(len(embeds), longest, embeds[0].shape[-1], dtype=self.dtype, device=self.device)
        pos = torch.full((len(embeds), longest), cache.max_len, dtype=torch.int64)
        for i, (e, s, n) in enumerate(zip(embeds, starts, lengths)):  # admission-time packing, not the step
            x[i, :n] = e
            pos[i, :n] = torch.arange(s, s + n)
        kv_len = max(s + n for s, n in zip(starts, lengths))
        slots = slots.to(self.device)
        h = self.talker.model(x, pos.to(self.device), cache.k, cache.v, slots, kv_len)
        last = torch.tensor(lengths, device=self.device) - 1
        return h[torch.arange(len(embeds), device=self.device), last]

    @torch.no_grad()
    def decode_step(self, slots: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                    kv_len: int | None = None) -> torch.Tensor:
        cache = self._require_cache()
        kv_len = cache.max_len if kv_len is None else kv_len
        h = self.talker.model(embeds[:, None].to(self.dtype), positions[:, None], cache.k, cache.v, slots, kv_len)
        return h[:, 0]

    @torch.no_grad()
    def sample_frame(self, slots: torch.Tensor, hidden: torch.Tensor, params: SamplingParams,
                     step: torch.Tensor) -> torch.Tensor:
        cache = self._require_cache()
        logits = self.talker.codec_head(hidden)
        seen = cache.seen[slots]
        noise0, noise_sub = self.frame_noise(params, step)
        code0 = sample_code0(logits, params, seen, step, self.cfg.talker.codec_eos_id, noise0)
        cache.seen[slots, code0] = True
        rest = self.code_predictor.predict(hidden, self.codec_embed(code0), params, step, noise_sub)
        return torch.cat((code0[:, None], rest), dim=1)

    def frame_noise(self, params: SamplingParams, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame's Gumbel noise, all 16 codebooks drawn at once (see ``sampling.frame_noise``)."""
        return frame_noise(params.seed, step, self.cfg.talker.decoder.vocab_size, self.cfg.talker.num_code_groups,
                           self.code_predictor.cfg.vocab_size)

    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """codes ``[..., 16]`` -> sum of the 16 code embeddings ``[..., H]`` (talker dim). With the tables fused
        (``fuse_projections``), one gather from the one table: the same rows, summed the same way."""
        if is_fused(self._frame_table, *self._frame_tables()):
            return self._frame_table[codes.to(self.device) + self._frame_offsets].sum(-2)
        parts = torch.cat((self.codec_embed(codes[..., :1]), self.code_predictor.embed_codes(codes[..., 1:])), -2)
        return parts.sum(-2)

    @torch.no_grad()
    def next_input(self, slots: torch.Tensor, codes: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        cache = self._require_cache()
        pad = self.special_embeds()[2]
        n = cache.trailing_len[slots]
        idx = torch.minimum(step, (n - 1).clamp(min=0))
        text = cache.trailing[slots, idx]
        text = torch.where((step < n)[:, None], text, pad)
        return self.frame_embed(codes) + text
