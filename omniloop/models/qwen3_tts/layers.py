"""Qwen3 decoder building blocks shared by the talker and the code predictor.

Attention reads and writes a *slot* KV cache: ``k_cache``/``v_cache`` of one layer are
``[num_slots, kv_heads, max_len, head_dim]``; a batch row names its slot and the absolute cache
position of each of its tokens. Prefill (many tokens per row) and decode (one token per row) are the
same code path, so a prompt prefilled with others gives the same keys as one prefilled alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.qwen3_tts.config import DecoderConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in float32 whatever the weight dtype, as the reference does
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: ``[B, L]`` (same on every axis) or ``[axes, B, L]``; returns cos, sin ``[B, L, head_dim]``."""
        if positions.dim() == 2:
            freqs = positions[..., None].float() * self.inv_freq
        else:
            pos = positions.float()[self.axis_of_freq]  # [half, B, L]: each frequency's own axis
            freqs = pos.permute(1, 2, 0) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, heads, L, D]``; cos/sin ``[B, L, D]``."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias, **kw)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias, **kw)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **kw)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **kw)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: torch.Tensor | None, write_pos: torch.Tensor, mask: torch.Tensor,
                kv_len: int) -> torch.Tensor:
        """x ``[B, L, H]``; ``write_pos`` ``[B, L]`` cache positions of x's tokens; ``mask`` ``[B, 1, L, kv_len]``
        (True = may attend). Reads keys ``[0, kv_len)`` of each row's slot after writing its own.
        ``slots=None``: row i is slot i, so the cache is read by slicing (a view) instead of gathering (a copy)."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        heads = torch.arange(self.num_kv_heads, device=x.device)
        rows = torch.arange(b, device=x.device) if slots is None else slots
        index = (rows[:, None, None], heads[None, :, None], write_pos[:, None, :])
        k_cache.index_put_(index, k)
        v_cache.index_put_(index, v)
        if slots is None:
            keys, values = k_cache[:b, :, :kv_len], v_cache[:b, :, :kv_len]
        else:
            keys, values = k_cache[slots, :, :kv_len], v_cache[slots, :, :kv_len]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, device, dtype)
        self.mlp = MLP(cfg, device, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: torch.Tensor | None, write_pos: torch.Tensor, mask: torch.Tensor,
                kv_len: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, slots, write_pos, mask, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Layers + final norm over a slot KV cache ``[layers, slots, kv_heads, max_len + 1, head_dim]``; the
    last position is scratch space that absorbs the writes of right-padding tokens in a batched prefill."""

    def __init__(self, cfg: DecoderConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, device, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.rope = Rope(cfg, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor | None, kv_len: int) -> torch.Tensor:
        """x ``[B, L, H]``, positions ``[B, L]`` absolute (also the cache positions written); ``slots=None``
        means row i uses slot i (see ``Attention``)."""
        rope = self.rope(positions, x.dtype)
        # the caller marks padding tokens with a position >= max_len; they land on the scratch position
        write_pos = positions.clamp(max=k_cache.shape[3] - 1)
        keys = torch.arange(kv_len, device=x.device)
        mask = (keys[None, None, None, :] <= positions[:, None, :, None])
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, k_cache[i], v_cache[i], slots, write_pos, mask, kv_len)
        return self.norm(x)
