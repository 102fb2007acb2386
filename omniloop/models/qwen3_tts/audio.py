"""Reference audio in: bytes or a file of any format libsndfile reads (wav, flac, ogg, mp3...) -> mono
float32 PCM at 24 kHz. Downmix by channel mean, resample with soxr. Errors name the problem."""

from __future__ import annotations

import io
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from threading import Lock

import numpy as np
import soundfile as sf
import soxr

TARGET_RATE = 24000
DEFAULT_MAX_SECONDS = 60.0
MAX_CACHED_RESAMPLERS = 16


class AudioDecodeError(ValueError):
    """The reference audio cannot be used; the message says why (unreadable, empty, too long, not finite)."""


@dataclass(frozen=True)
class Resampler:
    """soxr settings for one source rate; one-shot soxr calls keep no state, so it is safe to share."""

    in_rate: int
    out_rate: int
    quality: str = "HQ"

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        if self.in_rate == self.out_rate:
            return samples
        return soxr.resample(samples, self.in_rate, self.out_rate, quality=self.quality)


class _ResamplerCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple[int, int], Resampler] = OrderedDict()
        self._lock = Lock()

    def get(self, in_rate: int, out_rate: int) -> Resampler:
        key = (in_rate, out_rate)
        with self._lock:
            found = self._items.get(key)
            if found is None:
                found = self._items[key] = Resampler(in_rate, out_rate)
                if len(self._items) > self.capacity:
                    self._items.popitem(last=False)
            else:
                self._items.move_to_end(key)
            return found

    def __len__(self) -> int:
        return len(self._items)


resamplers = _ResamplerCache(MAX_CACHED_RESAMPLERS)


def to_mono(samples: np.ndarray, rate: int, out_rate: int = TARGET_RATE,
            max_seconds: float = DEFAULT_MAX_SECONDS) -> np.ndarray:
    """Decoded samples ``[n]`` or ``[n, channels]`` at ``rate`` -> owned mono float32 ``[m]`` at ``out_rate``."""
    x = np.asarray(samples)
    if x.ndim not in (1, 2):
        raise AudioDecodeError(f"reference audio must be [samples] or [samples, channels], got shape {x.shape}")
    if rate <= 0:
        raise AudioDecodeError(f"reference audio has an invalid sample rate {rate}")
    if x.shape[0] == 0:
        raise AudioDecodeError("reference audio is empty (0 samples)")
    if x.shape[0] > max_seconds * rate:
        raise AudioDecodeError(f"reference audio is {x.shape[0] / rate:.1f} s long; the limit is {max_seconds:g} s")
    x = x.astype(np.float32, copy=False)
    if x.ndim == 2:
        x = x.mean(axis=1, dtype=np.float32)
    if not np.isfinite(x).all():
        raise AudioDecodeError("reference audio contains NaN or infinite samples")
    out = resamplers.get(int(rate), out_rate)(np.ascontiguousarray(x))
    if out.shape[0] == 0:
        raise AudioDecodeError("reference audio is too short to resample to 24 kHz")
    return np.array(out, dtype=np.float32, copy=True)


def load_audio(source: bytes | bytearray | memoryview | str | Path, max_seconds: float = DEFAULT_MAX_SECONDS,
               out_rate: int = TARGET_RATE) -> np.ndarray:
    """Encoded audio (file bytes, or a path) -> mono float32 PCM at ``out_rate``."""
    name = str(source) if isinstance(source, (str, Path)) else "reference audio bytes"
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise AudioDecodeError("reference audio is empty (0 bytes)")
        handle: io.BytesIO | str = io.BytesIO(bytes(source))
    else:
        if not Path(source).is_file():
            raise AudioDecodeError(f"reference audio file {name} does not exist")
        handle = str(source)
    try:
        with sf.SoundFile(handle) as f:
            rate = f.samplerate
            # Refuse before decoding when the header already says it is too long (mp3/ogg may not know).
            if f.frames > 0 and f.frames > max_seconds * rate:
                raise AudioDecodeError(f"{name} is {f.frames / rate:.1f} s long; the limit is {max_seconds:g} s")
            data = f.read(frames=int(max_seconds * rate) + 1, dtype="float32", always_2d=True)
    except AudioDecodeError:
        raise
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise AudioDecodeError(f"{name} is not a readable audio file ({e})") from None
    return to_mono(data, rate, out_rate, max_seconds)
