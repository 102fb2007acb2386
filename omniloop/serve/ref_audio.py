"""Reference audio from an HTTP request: base64, a ``data:`` URI, or a path in an allow-listed folder.

Paths are resolved (symlinks and ``..`` included) before the containment check, so neither traversal
nor a symlink pointing out of the allow-list reaches a file outside it.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path

from omniloop.serve.api_errors import ApiError
from omniloop.serve.audio_format import is_decodable

MAX_REF_AUDIO_BYTES = 16 * 1024 * 1024


class RefAudioResolver:
    def __init__(self, allowed_dirs: list[str], max_bytes: int = MAX_REF_AUDIO_BYTES) -> None:
        self.allowed = [Path(d).resolve() for d in allowed_dirs]
        self.max_bytes = max_bytes

    def resolve(self, value: str) -> bytes:
        """The encoded audio file bytes for ``value``; raises ``ApiError`` naming the problem."""
        if value.startswith("data:"):
            data = self._from_data_uri(value)
        elif value.startswith("file://") or value.startswith("/") or value.startswith("."):
            data = self._from_path(value.removeprefix("file://"))
        elif value.startswith(("http://", "https://")):
            raise ApiError(400, "ref_audio URLs are not fetched by this server; send base64 or a data URI", "ref_audio")
        else:
            data = self._from_base64(value)
        self.check(data)
        return data

    def check(self, data: bytes) -> None:
        if len(data) > self.max_bytes:
            raise ApiError(413, f"ref_audio is {len(data)} bytes; the limit is {self.max_bytes}", "ref_audio")
        if not is_decodable(data):
            raise ApiError(400, "ref_audio is not a decodable audio file (wav, flac, ogg, mp3...)", "ref_audio")

    def _from_data_uri(self, uri: str) -> bytes:
        header, sep, payload = uri.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ApiError(400, "ref_audio data URI must look like data:audio/wav;base64,<data>", "ref_audio")
        return self._from_base64(payload)

    def _from_base64(self, text: str) -> bytes:
        # 4/3 expansion: refuse before decoding a huge string.
        if len(text) > self.max_bytes * 4 // 3 + 4:
            raise ApiError(413, f"ref_audio is larger than the limit of {self.max_bytes} bytes", "ref_audio")
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "ref_audio is neither valid base64, a data URI, nor an absolute path", "ref_audio") from None

    def _from_path(self, raw: str) -> bytes:
        if not self.allowed:
            raise ApiError(403, "ref_audio paths are disabled on this server (start it with --ref-audio-dir)", "ref_audio")
        path = Path(raw).resolve()
        if not any(path.is_relative_to(root) for root in self.allowed):
            raise ApiError(403, f"ref_audio path {raw!r} is outside the allowed directories", "ref_audio")
        if not path.is_file():
            raise ApiError(404, f"ref_audio file {raw!r} does not exist", "ref_audio")
        if os.path.getsize(path) > self.max_bytes:
            raise ApiError(413, f"ref_audio file is larger than the limit of {self.max_bytes} bytes", "ref_audio")
        return path.read_bytes()
