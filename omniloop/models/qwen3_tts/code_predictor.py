"""The code predictor ("sub-talker"): from the talker's hidden state and codebook 0 it predicts
codebooks 1..15 of the same frame, one codebook per step, batched over requests.

Each frame starts a fresh, tiny KV cache (at most 1 + 16 positions); every row of the batch is at the
same step, so positions and cache lengths are shared Python ints and the 15 steps have static shapes.
Its codec embeddings live in *talker* dimension; ``small_to_mtp_projection`` maps every input into the
predictor's own width (Identity when the two widths are equal, as in the 0.6B models).
"""

from __future__ import annotations

import torch
from torch import nn

from omniloop.models.qwen3_tts.config import TalkerConfig
from omniloop.models.qwen3_tts.layers import DecoderStack
from omniloop.models.qwen3_tts.sampling import SamplingParams, counter_uniform_groups, gumbel_noise, sample_sub


class CodePredictor(nn.Module):
    def __init__(self, cfg: TalkerConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        cp = cfg.code_predictor
        talker_hidden = cfg.decoder.hidden_size
        self.cfg = cp
        self.num_groups = cfg.num_code_groups
        kw = dict(device=device, dtype=dtype)
        self.model = DecoderStack(cp, device, dtype)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cp.vocab_size, talker_hidden, **kw) for _ in range(self.num_groups - 1))
        self.lm_head = nn.ModuleList(
            nn.Linear(cp.hidden_size, cp.vocab_size, bias=False, **kw) for _ in range(self.num_groups - 1))
        self.small_to_mtp_projection: nn.Module = (
            nn.Linear(talker_hidden, cp.hidden_size, bias=True, **kw) if cp.hidden_size != talker_hidden
            else nn.Identity())
        # (parameter key, [num_groups - 1, vocab, hidden]): every codebook's input row already projected
        self._inputs: tuple[tuple, torch.Tensor] | None = None

    def _input_key(self) -> tuple:
        params = (*(e.weight for e in self.codec_embedding), *self.small_to_mtp_projection.parameters())
        return tuple((id(p), p._version, p.data_ptr()) for p in params)

    def fuse_inputs(self) -> None:
        """Project every codebook's embedding table once (``[15, vocab, hidden]``): each step's input is then
        one row gather instead of a gather and a matmul (the CUDA path; same math, rounded once per row as
        the per-step projection would)."""
        if isinstance(self.small_to_mtp_projection, nn.Identity):  # (0.6B) the input is the embedding row
            return
        with torch.no_grad():
            table = self.small_to_mtp_projection(torch.cat([e.weight for e in self.codec_embedding]))
        self._inputs = (self._input_key(), table.view(len(self.codec_embedding), -1, table.shape[-1]))

    def inputs_fused(self) -> bool:
        if isinstance(self.small_to_mtp_projection, nn.Identity):
            return True  # nothing to project: each step gathers its embedding row
        return self._inputs is not None and self._inputs[0] == self._input_key()

    def step_input(self, code: torch.Tensor, group: int) -> torch.Tensor:
        """The predictor's input ``[B, hidden]`` for the step after sampling codebook ``group + 1`` as
        ``code`` ``[B]``: the projected table's row once ``fuse_inputs`` ran (checked current), else the
        embedding and the projection."""
        if self._inputs is None:
            return self.small_to_mtp_projection(self.codec_embedding[group](code))
        if self._inputs[0] != self._input_key():
            raise RuntimeError("the code predictor's projected input table is stale (its embedding or projection "
                               "parameters changed after it was built); call Qwen3TtsModel.fuse_projections() again")
        return self._inputs[1][group][code]

    def new_cache(self, batch: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cp = self.cfg
        shape = (cp.num_layers, batch, cp.num_kv_heads, self.num_groups + 1, cp.head_dim)
        # never read before written: every step attends only over the positions already filled
        return torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype)

    def predict(self, hidden: torch.Tensor, code0_embed: torch.Tensor, params: SamplingParams,
                step: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """hidden, code0_embed ``[B, H_talker]`` -> codebooks 1..15 ``[B, num_groups - 1]``. ``noise``: the
        frame's Gumbel noise of codebooks 1..15 ``[B, 15, vocab]`` (``sampling.frame_noise``), drawn here
        when not given."""
        b = hidden.shape[0]
        if noise is None:
            noise = gumbel_noise(counter_uniform_groups(params.seed, step, 1, self.num_groups - 1,
                                                        self.cfg.vocab_size))
        # row i owns cache row i, so attention reads it by slicing (slots=None) rather than gathering;
        # every row is at the same step, so positions are Python ints: no mask, no position tensors
        k_cache, v_cache = self.new_cache(b, hidden.device, hidden.dtype)
        x = self.small_to_mtp_projection(torch.stack((hidden, code0_embed), dim=1))
        out = self.model(x, 0, k_cache, v_cache, None, kv_len=2)[:, -1]
        codes = []
        for g in range(self.num_groups - 1):
            code = sample_sub(self.lm_head[g](out), params, step, g + 1, noise[:, g])
            codes.append(code)
            if g == self.num_groups - 2:
                break
            x = self.step_input(code, g)[:, None]
            out = self.model(x, g + 2, k_cache, v_cache, None, kv_len=g + 3)[:, 0]
        return torch.stack(codes, dim=1)

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """codes ``[..., num_groups - 1]`` (codebooks 1..15) -> their talker-dim embeddings ``[..., 15, H]``."""
        return torch.stack([emb(codes[..., g]) for g, emb in enumerate(self.codec_embedding)], dim=-2)
