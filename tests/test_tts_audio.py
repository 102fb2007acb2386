"""Reference-audio loading (any format -> mono 24 kHz) and the processed-reference cache."""
from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from omniloop.models.qwen3_tts import audio
from omniloop.models.qwen3_tts.audio import AudioDecodeError, load_audio
from omniloop.models.qwen3_tts.ref_cache import RefCache, file_key, pcm_key


def encoded(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


def tone(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    mono = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return mono if channels == 1 else np.stack([mono, -mono * 0.5], axis=1)


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG"])
def test_formats_decode_to_mono_24k(fmt: str) -> None:
    pcm = load_audio(encoded(tone(0.5, 16000, channels=2), 16000, fmt))
    assert pcm.dtype == np.float32 and pcm.ndim == 1
    assert abs(pcm.shape[0] - 12000) <= 2
    assert 0.07 < np.abs(pcm).max() < 0.08  # channel mean of 0.3 and -0.15 amplitude: 0.075


def test_file_path_and_rate_passthrough(tmp_path: Path) -> None:
    path = tmp_path / "ref.wav"
    sf.write(path, tone(0.25, 24000), 24000, subtype="FLOAT")
    np.testing.assert_array_equal(load_audio(path), tone(0.25, 24000))


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(AudioDecodeError, match="not a readable audio file"):
        load_audio(b"definitely not audio")
    with pytest.raises(AudioDecodeError, match="empty"):
        load_audio(b"")
    with pytest.raises(AudioDecodeError, match="empty"):
        load_audio(encoded(np.zeros(0, dtype=np.float32), 16000, "WAV"))
    with pytest.raises(AudioDecodeError, match="limit is 1 s"):
        load_audio(encoded(tone(1.5, 8000), 8000, "WAV"), max_seconds=1.0)
    with pytest.raises(AudioDecodeError, match="does not exist"):
        load_audio(tmp_path / "missing.wav")


def test_resampler_cache_is_bounded_lru() -> None:
    cache = audio._ResamplerCache(capacity=16)
    first = cache.get(8000, 24000)
    for rate in range(9000, 9016):
        cache.get(rate, 24000)
    assert len(cache) == 16
    assert cache.get(8000, 24000) is not first  # the oldest was evicted and rebuilt


def entry_arrays(seed: int, frames: int = 10) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(64).astype(np.float32), rng.integers(0, 2048, (frames, 16))


def test_eviction_by_count_is_lru() -> None:
    cache = RefCache(max_entries=2)
    for key in ("a", "b"):
        cache.put(key, *entry_arrays(0))
    assert cache.get("a") is not None  # "b" is now the least recently used
    cache.put("c", *entry_arrays(1))
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.num_evictions == 1


def test_eviction_by_bytes_counts_real_nbytes() -> None:
    spk, codes = entry_arrays(0)
    one = spk.nbytes + codes.astype(np.int64).nbytes
    cache = RefCache(max_bytes=2 * one + one // 2)
    for key in ("a", "b", "c"):
        cache.put(key, spk, codes)
    assert len(cache) == 2 and "a" not in cache
    assert cache.nbytes == 2 * one
    big = cache.put("huge", np.zeros(10 * one // 4, dtype=np.float32), None)
    assert "huge" not in cache and big.nbytes > cache.max_bytes  # returned, never stored


def test_cached_arrays_are_owned_copies() -> None:
    backing = np.zeros((1000, 16), dtype=np.int64)
    codes_view = backing[100:110]
    spk = np.ones(64, dtype=np.float64)
    entry = RefCache().put(pcm_key(np.zeros(10, np.float32), icl=True), spk, codes_view)
    backing[:] = 7
    spk[:] = 3
    assert entry.codes.base is None and entry.codes.flags.owndata and not entry.codes.flags.writeable
    assert entry.speaker.dtype == np.float32 and entry.codes.dtype == np.int64
    assert (entry.codes == 0).all() and (entry.speaker == 1).all()
    assert entry.nbytes == 64 * 4 + 10 * 16 * 8


def test_content_key_depends_on_pcm_and_params() -> None:
    pcm = np.arange(100, dtype=np.float32)
    assert pcm_key(pcm, icl=True) == pcm_key(pcm.copy(), icl=True)
    assert pcm_key(pcm, icl=True) != pcm_key(pcm, icl=False)
    changed = pcm.copy()
    changed[5] += 1
    assert pcm_key(changed, icl=True) != pcm_key(pcm, icl=True)


def test_file_entry_invalidated_when_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "ref.wav"
    path.write_bytes(b"version one")
    cache = RefCache()
    key, hit = cache.get_file(path, icl=True)
    assert hit is None
    cache.put(key, *entry_arrays(0))
    assert cache.get_file(path, icl=True)[1] is not None
    path.write_bytes(b"version two, longer")
    os.utime(path, ns=(1, 1_000_000_000))
    new_key, hit = cache.get_file(path, icl=True)
    assert hit is None and new_key != key
    assert len(cache) == 0 and cache.nbytes == 0  # the stale entry is gone, not just shadowed
    assert file_key(path, icl=True) == new_key
