"""Qwen3-TTS 12 Hz codec encoder (the Mimi encoder half): 24 kHz mono -> codes ``[ceil(n / 1920), 16]``.

SEANet causal conv stack (25 Hz) -> causal transformer -> stride-2 downsample (12.5 Hz) -> split RVQ
(1 semantic + the first 15 acoustic codebooks, each picked by nearest Euclidean neighbour). Used once per
reference audio (Base voice clone, in-context), so it is a plain one-shot forward.

Module names follow the checkpoint keys (``encoder.*`` in ``speech_tokenizer/model.safetensors``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omniloop.models.qwen3_tts.speech_config import EncoderConfig
from omniloop.models.qwen3_tts.speech_layers import LayerScale, apply_rope, rope_cos_sin


class _Conv(nn.Module):
    """Causal conv with Mimi's padding: ``k_eff - stride`` on the left, and on the right just enough
    for the last window to be complete."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1, bias: bool = True,
                 pad_mode: str = "constant") -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride, dilation=dilation, bias=bias)
        self.k_eff = (kernel - 1) * dilation + 1
        self.stride = stride
        self.pad_mode = pad_mode

    def forward(self, x: Tensor) -> Tensor:
        length, k, s = x.shape[-1], self.k_eff, self.stride
        left = k - s
        num_frames = math.ceil((length - k + left) / s + 1) - 1
        right = num_frames * s + k - left - length
        return self.conv(F.pad(x, (left, right), mode=self.pad_mode))


class _ResBlock(nn.Module):
    def __init__(self, cfg: EncoderConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList([
            nn.ELU(), _Conv(dim, hidden, cfg.residual_kernel_size, dilation=dilation, pad_mode=cfg.pad_mode),
            nn.ELU(), _Conv(hidden, dim, 1, pad_mode=cfg.pad_mode),
        ])

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


class _Seanet(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = [_Conv(cfg.audio_channels, cfg.num_filters, cfg.kernel_size, pad_mode=cfg.pad_mode)]
        scale = 1
        for ratio in reversed(cfg.upsampling_ratios):
            dim = scale * cfg.num_filters
            layers += [_ResBlock(cfg, dim, cfg.dilation_growth_rate ** j) for j in range(cfg.num_residual_layers)]
            layers += [nn.ELU(), _Conv(dim, 2 * dim, 2 * ratio, stride=ratio, pad_mode=cfg.pad_mode)]
            scale *= 2
        layers += [nn.ELU(), _Conv(scale * cfg.num_filters, cfg.hidden_size, cfg.last_kernel_size,
                                   pad_mode=cfg.pad_mode)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attn_head_dim
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=b)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=b)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        bsz, n, _ = x.shape
        q = apply_rope(self.q_proj(x).view(bsz, n, self.num_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(bsz, n, self.num_kv, self.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(bsz, n, self.num_kv, self.head_dim).transpose(1, 2)
        rep = self.num_heads // self.num_kv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # Full causal attention: the reference builds a plain causal mask here (its sliding_window is unused).
        out = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, n, -1))


class _Mlp(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, 0.01)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, 0.01)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class _Transformer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.head_dim, self.theta = cfg.attn_head_dim, cfg.rope_theta

    def forward(self, x: Tensor) -> Tensor:
        pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        cos, sin = rope_cos_sin(pos, self.head_dim, self.theta)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))

    def table(self) -> Tensor:
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _VQ(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.codebook = _Codebook(size, dim)


class _RVQ(nn.Module):
    def __init__(self, cfg: EncoderConfig, num: int) -> None:
        super().__init__()
        dim = cfg.vector_quantization_hidden_dimension
        self.layers = nn.ModuleList(_VQ(cfg.codebook_size, dim) for _ in range(num))
        self.has_proj = dim != cfg.hidden_size
        if self.has_proj:
            self.input_proj = nn.Conv1d(cfg.hidden_size, dim, 1, bias=False)
            self.output_proj = nn.Conv1d(dim, cfg.hidden_size, 1, bias=False)  # decode side; kept so keys load

    def encode(self, x: Tensor, num: int) -> Tensor:
        """x ``[B, C, T]`` -> indices ``[num, B, T]``: greedy residual nearest-neighbour search."""
        if self.has_proj:
            x = self.input_proj(x)
        residual = x.transpose(1, 2)
        out = []
        for vq in self.layers[:num]:
            table = vq.codebook.table()
            flat = residual.reshape(-1, residual.shape[-1])
            idx = torch.cdist(flat[None].float(), table[None].float(), p=2)[0].argmin(dim=-1)
            idx = idx.view(residual.shape[:-1])
            residual = residual - F.embedding(idx, table)
            out.append(idx)
        return torch.stack(out)


class _SplitRVQ(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.num_semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = _RVQ(cfg, cfg.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = _RVQ(cfg, cfg.num_quantizers - cfg.num_semantic_quantizers)

    def encode(self, x: Tensor, num: int) -> Tensor:
        """``[B, C, T]`` -> ``[B, num, T]``; both halves quantize the same embedding."""
        codes = [self.semantic_residual_vector_quantizer.encode(x, self.num_semantic)]
        if num > self.num_semantic:
            codes.append(self.acoustic_residual_vector_quantizer.encode(x, num - self.num_semantic))
        return torch.cat(codes).transpose(0, 1)


class SpeechEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig, num_quantizers: int = 16, samples_per_frame: int = 1920) -> None:
        super().__init__()
        if not cfg.num_semantic_quantizers <= num_quantizers <= cfg.num_quantizers:
            raise ValueError(f"encoder_valid_num_quantizers {num_quantizers} must be within "
                             f"[{cfg.num_semantic_quantizers}, {cfg.num_quantizers}]")
        self.cfg = cfg
        self.num_quantizers = num_quantizers
        self.samples_per_frame = samples_per_frame
        self.encoder = _Seanet(cfg)
        self.encoder_transformer = _Transformer(cfg)
        stride_ratio = int(cfg.encodec_frame_rate / cfg.frame_rate)
        self.downsample = _Conv(cfg.hidden_size, cfg.hidden_size, 2 * stride_ratio, stride=2, bias=False,
                                pad_mode="replicate")
        self.quantizer = _SplitRVQ(cfg)

    @torch.inference_mode()
    def encode(self, pcm: np.ndarray | Tensor) -> Tensor:
        """24 kHz mono float ``[n]`` -> int64 codes ``[ceil(n / 1920), num_quantizers]`` (on CPU)."""
        x = torch.as_tensor(pcm)
        if x.ndim != 1 or x.numel() == 0:
            raise ValueError(f"reference audio must be a non-empty 1-D array, got shape {list(x.shape)}")
        p = self.encoder.layers[0].conv.weight
        x = x.to(device=p.device, dtype=p.dtype)[None, None]
        h = self.encoder(x)
        h = self.encoder_transformer(h.transpose(1, 2)).transpose(1, 2)
        h = self.downsample(h)
        codes = self.quantizer.encode(h, self.num_quantizers)[0]
        num_frames = -(-pcm.shape[0] // self.samples_per_frame)
        return codes[:, :num_frames].transpose(0, 1).to("cpu", torch.int64)
