"""ECAPA-TDNN speaker encoder: 24 kHz reference audio -> x-vector ``[enc_dim]`` for the Base talker's
speaker slot. TDNN -> SE-Res2Net blocks -> multi-layer aggregation -> attentive statistics pooling -> 1x1.

Weights are the ``speaker_encoder.*`` keys of the main checkpoint (Base variant only). It runs once per
reference clip and is small, so it stays in float32 whatever the talker's dtype.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from omniloop.models.qwen3_tts.mel import log_mel
from omniloop.models.qwen3_tts.speech_checkpoint import dummy_init_, find_weights, load_module, read_prefixed
from omniloop.models.qwen3_tts.speech_config import SpeakerEncoderConfig, read_json


def _conv(cin: int, cout: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    # Time-symmetric "same" padding by reflection: the embedding is a whole-clip statistic, not causal.
    return nn.Conv1d(cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class _Tdnn(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = _conv(cin, cout, kernel, dilation)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.conv(x))


class _Res2Net(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        if channels % scale:
            raise ValueError(f"speaker encoder channels {channels} not divisible by res2net scale {scale}")
        width = channels // scale
        self.blocks = nn.ModuleList(_Tdnn(width, width, kernel, dilation) for _ in range(scale - 1))
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        parts = torch.chunk(x, self.scale, dim=1)
        outs, prev = [parts[0]], None
        for block, part in zip(self.blocks, parts[1:]):
            prev = block(part if prev is None else part + prev)
            outs.append(prev)
        return torch.cat(outs, dim=1)


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, se_channels: int) -> None:
        super().__init__()
        self.conv1 = _conv(channels, se_channels, 1)
        self.conv2 = _conv(se_channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.sigmoid(self.conv2(torch.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class _SeRes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se_channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        if cin != cout:
            raise ValueError(f"SE-Res2Net block needs equal in/out channels, got {cin} -> {cout}")
        self.tdnn1 = _Tdnn(cin, cout, 1, 1)
        self.res2net_block = _Res2Net(cout, scale, kernel, dilation)
        self.tdnn2 = _Tdnn(cout, cout, 1, 1)
        self.se_block = _SqueezeExcite(cout, se_channels)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _stats(x: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    mean = (weights * x).sum(dim=2)
    std = torch.sqrt((weights * (x - mean[..., None]).pow(2)).sum(dim=2).clamp(min=1e-12))
    return mean, std


class _AttentivePooling(nn.Module):
    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = _Tdnn(3 * channels, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        length = x.shape[-1]
        uniform = torch.full((1, 1, length), 1.0 / length, dtype=x.dtype, device=x.device)
        mean, std = _stats(x, uniform)
        context = torch.cat([x, mean[..., None].expand_as(x), std[..., None].expand_as(x)], dim=1)
        attn = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _stats(x, attn)
        return torch.cat([mean, std], dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    def __init__(self, cfg: SpeakerEncoderConfig) -> None:
        super().__init__()
        ch, ks, ds = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        if sum(ch[1:-1]) != ch[-1]:
            raise ValueError(f"speaker_encoder_config: enc_channels {list(ch)}: the middle blocks must sum to "
                             f"the last entry (multi-layer aggregation)")
        self.cfg = cfg
        self.blocks = nn.ModuleList([_Tdnn(cfg.mel_dim, ch[0], ks[0], ds[0])])
        self.blocks.extend(_SeRes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], ds[i])
                           for i in range(1, len(ch) - 1))
        self.mfa = _Tdnn(ch[-1], ch[-1], ks[-1], ds[-1])
        self.asp = _AttentivePooling(ch[-1], cfg.enc_attention_channels)
        self.fc = _conv(2 * ch[-1], cfg.enc_dim, 1)

    def forward(self, mels: Tensor) -> Tensor:
        """log-mels ``[B, frames, mel_dim]`` -> x-vectors ``[B, enc_dim]``."""
        x = self.blocks[0](mels.transpose(1, 2))
        outs = []
        for block in self.blocks[1:]:
            x = block(x)
            outs.append(x)
        x = self.asp(self.mfa(torch.cat(outs, dim=1)))
        return self.fc(x)[..., 0]

    @torch.inference_mode()
    def embed(self, pcm: np.ndarray | Tensor) -> np.ndarray:
        """24 kHz mono float ``[n]`` -> float32 x-vector ``[enc_dim]`` (an owned numpy array)."""
        x = torch.as_tensor(pcm)
        if x.ndim != 1:
            raise ValueError(f"reference audio must be 1-D, got shape {list(x.shape)}")
        p = self.fc.weight
        mels = log_mel(x.to(device=p.device, dtype=torch.float32)[None])
        if mels.shape[1] < 1:
            raise ValueError(f"reference audio of {x.shape[0]} samples is too short for a speaker embedding")
        return self(mels.to(p.dtype))[0].float().cpu().numpy().copy()

    @classmethod
    def load(cls, model_dir: str | Path, device: str | torch.device = "cpu", load_format: str = "auto",
             seed: int = 0) -> SpeakerEncoder:
        """From the main checkpoint folder: ``speaker_encoder_config`` in config.json and the
        ``speaker_encoder.*`` weights (Base checkpoints only)."""
        folder = Path(model_dir)
        cfg_path = folder / "config.json"
        cfg = SpeakerEncoderConfig.from_model_config(read_json(cfg_path), str(cfg_path))
        model = cls(cfg)
        if load_format == "dummy":
            dummy_init_(model, seed)
        elif load_format == "auto":
            files = find_weights(folder)
            tensors = read_prefixed(files, "speaker_encoder.")
            if not tensors:
                raise KeyError(f"{folder}: no 'speaker_encoder.*' weights (only Base checkpoints have a speaker "
                               "encoder)")
            load_module(model, tensors, str(folder), "speaker_encoder.")
        else:
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
        return model.to(device=device, dtype=torch.float32).eval()
