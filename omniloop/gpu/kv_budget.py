"""Size the talker's slot KV cache from the stage's memory budget.

budget = gpu_memory_fraction x total device memory - weights - reserve (activations, graph pool).
Each slot holds ``max_len + 1`` positions (the last is scratch) of K and V in every layer, plus one
trailing-text row per position (the runner sizes the trailing buffer at ``max_len``) and its code-0
history. Slots are not negotiable (the scheduler hands out slot ids up to ``max_num_seqs``), so the
budget decides ``max_len``, or refuses with the numbers that did not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniloop.models.qwen3_tts.config import TtsConfig

GiB = 1 << 30
DEFAULT_RESERVE_BYTES = 2 * GiB


@dataclass(frozen=True)
class KvSizing:
    num_slots: int
    max_len: int
    bytes_per_token: int  # per slot position: K + V of every layer + one trailing-text row
    bytes_per_slot_fixed: int  # code-0 history, sampling state, next input
    budget_bytes: int

    @property
    def cache_bytes(self) -> int:
        return self.num_slots * ((self.max_len + 1) * self.bytes_per_token + self.bytes_per_slot_fixed)


def talker_bytes_per_token(cfg: TtsConfig, dtype: torch.dtype) -> int:
    dec = cfg.talker.decoder
    size = torch.empty((), dtype=dtype).element_size()
    return dec.num_layers * 2 * dec.num_kv_heads * dec.head_dim * size + dec.hidden_size * size


def talker_bytes_per_slot(cfg: TtsConfig, dtype: torch.dtype) -> int:
    dec = cfg.talker.decoder
    return dec.vocab_size + dec.hidden_size * torch.empty((), dtype=dtype).element_size() + 64


def size_talker_kv(stage: str, cfg: TtsConfig, dtype: torch.dtype, *, max_num_seqs: int, total_bytes: int,
                   gpu_memory_fraction: float, weight_bytes: int, max_len: int | None = None,
                   reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> KvSizing:
    """``max_len=None``: the longest context the budget allows (capped at the model's max positions).
    Raises ``ValueError`` naming the stage and the numbers when the cache does not fit."""
    if not 0.0 < gpu_memory_fraction <= 1.0:
        raise ValueError(f"stage {stage!r}: gpu_memory_fraction={gpu_memory_fraction} must be in (0, 1]")
    per_token = talker_bytes_per_token(cfg, dtype)
    per_slot = talker_bytes_per_slot(cfg, dtype)
    budget = int(gpu_memory_fraction * total_bytes) - weight_bytes - reserve_bytes
    where = (f"gpu_memory_fraction {gpu_memory_fraction} x {total_bytes / GiB:.1f} GiB total - "
             f"{weight_bytes / GiB:.2f} GiB weights - {reserve_bytes / GiB:.2f} GiB reserve = {budget / GiB:.2f} GiB")
    if max_len is None:
        fit = budget // max_num_seqs - per_slot
        max_len = min(fit // per_token - 1, cfg.talker.decoder.max_position_embeddings)
        if max_len < 1:
            raise ValueError(f"stage {stage!r}: no KV cache fits for {max_num_seqs} slots ({per_token} B per "
                             f"position per slot); budget: {where}. Lower max_num_seqs or raise gpu_memory_fraction")
    sizing = KvSizing(max_num_seqs, max_len, per_token, per_slot, budget)
    if sizing.cache_bytes > budget:
        raise ValueError(f"stage {stage!r}: KV cache for {max_num_seqs} slots x {max_len} positions needs "
                         f"{sizing.cache_bytes / GiB:.2f} GiB ({per_token} B per position per slot) but the budget "
                         f"is {where}. Lower max_num_seqs or max_len, or raise gpu_memory_fraction")
    return sizing


def module_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
