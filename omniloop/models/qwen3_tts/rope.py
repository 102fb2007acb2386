"""Rotary position embedding of the Qwen3 decoders: frequencies per position axis (multimodal rope splits them
among three axes), a per-length cos/sin table for the CUDA path, and the reference rotation."""

from __future__ import annotations

import torch
from torch import nn

from omniloop.models.qwen3_tts.config import DecoderConfig


class Rope(nn.Module):
    """Rotary embedding; with ``mrope_section`` the frequencies are split among three position axes
    (temporal, height, width), either in contiguous blocks or interleaved (freq i -> axis i % 3 while
    that axis has frequencies left). TTS feeds three equal axes, which reduces to ordinary RoPE."""

    def __init__(self, cfg: DecoderConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        half = cfg.head_dim // 2
        exponent = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** exponent)
        axis = torch.zeros(half, dtype=torch.int64)
        if cfg.mrope_section is not None:
            section = cfg.mrope_section
            if cfg.mrope_interleaved:
                for a in range(1, len(section)):
                    axis[a: section[a] * len(section): len(section)] = a
            else:
                axis = torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("axis_of_freq", axis.to(device), persistent=False)
        self.num_axes = 1 if cfg.mrope_section is None else len(cfg.mrope_section)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: ``[B, L]`` (same on every axis) or ``[axes, B, L]``; returns cos, sin ``[B, L, head_dim]``."""
        if positions.dim() == 2:
            freqs = positions[..., None].float() * self.inv_freq
        else:
            pos = positions.float()[self.axis_of_freq]  # [half, B, L]: each frequency's own axis
            freqs = pos.permute(1, 2, 0) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin and sign-folded sin (``-sin`` on the first half) ``[length, head_dim]`` of positions
        ``0..length-1``: the same values ``forward`` computes, looked up instead of recomputed per step.
        Built on first use; graph capture warms up first, so the table exists before any capture."""
        key = (length, dtype, self.inv_freq.device, self.inv_freq._version)
        if key not in self._tables:
            pos = torch.arange(length, device=self.inv_freq.device)[None]
            cos, sin = (t[0] for t in self.forward(pos, dtype))
            self._tables = {key: (cos, sin, fold_sin(sin))}
        return self._tables[key]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` of x's halves along the last dim: the partner of each lane in the rotation."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def fold_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` ``[..., D]`` with its first half negated: ``x * cos + x.roll(D / 2) * fold_sin(sin)`` is the
    rotation ``x * cos + rotate_half(x) * sin``, the form the CUDA kernels (``qk_norm_rope``) read."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), -1)
