"""Turning float32 PCM into the bytes a client asked for.

Whole files go through soundfile (libsndfile). Streams are either raw s16le PCM, or WAV whose RIFF/data
sizes are the 0xFFFFFFFF placeholder (players read until EOF; the length is unknown when the first
byte leaves). mp3 and opus are offered only when this machine's libsndfile can encode them.
"""

from __future__ import annotations

import io
import struct
from typing import Final

import numpy as np
import soundfile as sf

SAMPLE_RATE: Final = 24000

CONTENT_TYPE: Final[dict[str, str]] = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
}

# (libsndfile container, subtype) for formats written whole by soundfile.
_SF_FORMAT: Final[dict[str, tuple[str, str]]] = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}

STREAMABLE: Final = frozenset({"pcm", "wav"})


def _can_encode(fmt: str) -> bool:
    container, subtype = _SF_FORMAT[fmt]
    return container in sf.available_formats() and subtype in sf.available_subtypes(container)


# Probed once at import: libsndfile builds differ in mp3/opus support.
SUPPORTED: Final[tuple[str, ...]] = ("wav", "pcm") + tuple(f for f in ("flac", "mp3", "opus") if _can_encode(f))


def to_s16le(pcm: np.ndarray) -> bytes:
    """float32 [-1, 1] -> little-endian int16 bytes (clipped, rounded)."""
    scaled = np.clip(pcm, -1.0, 1.0) * 32767.0
    return np.rint(scaled).astype("<i2").tobytes()


def wav_stream_header(sample_rate: int = SAMPLE_RATE, channels: int = 1) -> bytes:
    """A 44-byte PCM16 WAV header with unknown (0xFFFFFFFF) RIFF and data sizes."""
    byte_rate = sample_rate * channels * 2
    return (
        b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, byte_rate, channels * 2, 16)
        + b"data" + struct.pack("<I", 0xFFFFFFFF)
    )


def encode_file(pcm: np.ndarray, fmt: str, sample_rate: int = SAMPLE_RATE) -> bytes:
    """The whole clip in ``fmt`` (one of ``SUPPORTED``)."""
    if fmt == "pcm":
        return to_s16le(pcm)
    container, subtype = _SF_FORMAT[fmt]
    buf = io.BytesIO()
    sf.write(buf, np.asarray(pcm, dtype=np.float32), sample_rate, format=container, subtype=subtype)
    return buf.getvalue()


def is_decodable(data: bytes) -> bool:
    """Whether libsndfile recognises ``data`` as an audio file (reads the header only)."""
    try:
        sf.info(io.BytesIO(data))
    except Exception:  # libsndfile raises several types for garbage; all mean "not audio"
        return False
    return True
