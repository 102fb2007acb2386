"""Log-mel front end of the speaker encoder (REFERENCE.md 3.4).

n_fft 1024, hop 256, window 1024 (periodic Hann), 128 Slaney mel bands over 0..12 kHz, reflect pad of
(n_fft - hop) / 2 on both sides with no STFT centering, magnitude sqrt(re² + im² + 1e-9),
log(clamp(·, 1e-5)). The filterbank follows librosa's Slaney construction (float64 maths, float32 weights).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

N_FFT = 1024
HOP = 256
WIN = 1024
NUM_MELS = 128
FMIN = 0.0
FMAX = 12000.0
SAMPLE_RATE = 24000

_F_SP = 200.0 / 3  # Slaney: linear below 1 kHz at 200/3 Hz per mel, logarithmic above
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = np.log(6.4) / 27.0


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / _F_SP
    high = hz >= _MIN_LOG_HZ
    return np.where(high, _MIN_LOG_MEL + np.log(np.maximum(hz, 1e-300) / _MIN_LOG_HZ) / _LOGSTEP, mel)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    hz = _F_SP * mel
    return np.where(mel >= _MIN_LOG_MEL, _MIN_LOG_HZ * np.exp(_LOGSTEP * (mel - _MIN_LOG_MEL)), hz)


@lru_cache(maxsize=4)
def mel_filterbank(sr: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = NUM_MELS, fmin: float = FMIN,
                   fmax: float = FMAX) -> np.ndarray:
    """Slaney-normalised triangular filters ``[n_mels, n_fft // 2 + 1]`` float32 (read-only)."""
    fft_hz = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    edges = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    widths = np.diff(edges)
    ramps = np.subtract.outer(edges, fft_hz)
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper)).astype(np.float32)
    enorm = 2.0 / (edges[2:] - edges[:-2])
    weights = (weights.astype(np.float64) * enorm[:, None]).astype(np.float32)
    weights.setflags(write=False)
    return weights


def log_mel(pcm: Tensor) -> Tensor:
    """24 kHz float PCM ``[B, n]`` -> log-mel ``[B, frames, 128]`` with frames = n // 256."""
    if pcm.ndim != 2:
        raise ValueError(f"pcm must be [B, n], got {list(pcm.shape)}")
    pad = (N_FFT - HOP) // 2
    if pcm.shape[-1] <= pad:
        raise ValueError(f"audio of {pcm.shape[-1]} samples is too short for the mel front end (needs > {pad})")
    basis = torch.from_numpy(mel_filterbank().copy()).to(pcm.device)
    y = torch.nn.functional.pad(pcm.float()[:, None], (pad, pad), mode="reflect")[:, 0]
    spec = torch.stft(y, N_FFT, hop_length=HOP, win_length=WIN, window=torch.hann_window(WIN, device=pcm.device),
                      center=False, normalized=False, onesided=True, return_complex=True)
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    return torch.log(torch.clamp(basis @ mag, min=1e-5)).transpose(1, 2)
