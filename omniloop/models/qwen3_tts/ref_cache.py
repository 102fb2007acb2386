"""Cache of processed reference audio (Base voice clone): the speaker x-vector and the reference codes.

Keyed by content (blake2b of the 24 kHz PCM bytes plus the parameters that change the result), and for
files also by (resolved path, size, mtime_ns): a file that changes on disk gets a new key and its old entry
is dropped. Entries hold owned, read-only copies (never views into a request's buffers), and the byte
budget counts their real ``nbytes``. Least-recently-used entries go first when either limit is passed.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from threading import Lock

import numpy as np

FileKey = tuple[str, int, int, str]


@dataclass(frozen=True)
class RefEntry:
    speaker: np.ndarray | None  # float32 [enc_dim]
    codes: np.ndarray | None  # int64 [n, 16]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.speaker, self.codes) if a is not None)


def _owned(x: np.ndarray | None, dtype: type) -> np.ndarray | None:
    if x is None:
        return None
    out = np.array(x, dtype=dtype, copy=True, order="C")
    out.setflags(write=False)
    return out


def _params_text(params: dict[str, object]) -> str:
    return ";".join(f"{k}={params[k]!r}" for k in sorted(params))


def pcm_key(pcm: np.ndarray, **params: object) -> str:
    """Content key of 24 kHz float32 PCM plus the task parameters (e.g. ``icl=True``, model name)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(np.ascontiguousarray(pcm, dtype=np.float32).tobytes())
    h.update(b"\0" + _params_text(params).encode())
    return h.hexdigest()


def file_key(path: str | Path, **params: object) -> FileKey:
    """(resolved path, size, mtime_ns, params): any change to the file gives a different key."""
    resolved = os.path.realpath(path)
    st = os.stat(resolved)
    return resolved, st.st_size, st.st_mtime_ns, _params_text(params)


class RefCache:
    def __init__(self, max_entries: int = 1024, max_bytes: int = 512 << 20) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"ref cache limits must be positive, got max_entries={max_entries} max_bytes={max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.num_hits = self.num_misses = self.num_evictions = 0
        self._entries: OrderedDict[str | FileKey, RefEntry] = OrderedDict()
        self._file_keys: dict[tuple[str, str], FileKey] = {}  # (path, params) -> its current key
        self._lock = Lock()  # the frontend and a stage thread may share one cache

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str | FileKey) -> bool:
        return key in self._entries

    def get(self, key: str | FileKey) -> RefEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.num_misses += 1
                return None
            self._entries.move_to_end(key)
            self.num_hits += 1
            return entry

    def put(self, key: str | FileKey, speaker: np.ndarray | None, codes: np.ndarray | None) -> RefEntry:
        """Store owned copies; returns the entry (stored unless it alone exceeds ``max_bytes``)."""
        entry = RefEntry(_owned(speaker, np.float32), _owned(codes, np.int64))
        with self._lock:
            self._drop(key)
            if entry.nbytes > self.max_bytes:
                return entry
            if isinstance(key, tuple):
                path_params = (key[0], key[3])
                old = self._file_keys.get(path_params)
                if old is not None and old != key:
                    self._drop(old)
                self._file_keys[path_params] = key
            self._entries[key] = entry
            self.nbytes += entry.nbytes
            while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
                oldest = next(iter(self._entries))
                self._drop(oldest)
                self.num_evictions += 1
            return entry

    def get_file(self, path: str | Path, **params: object) -> tuple[FileKey, RefEntry | None]:
        """Look a file up by its current stat; an entry for an older version of it is dropped."""
        key = file_key(path, **params)
        with self._lock:
            old = self._file_keys.get((key[0], key[3]))
            if old is not None and old != key:
                self._drop(old)
        return key, self.get(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._file_keys.clear()
            self.nbytes = 0

    def _drop(self, key: str | FileKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.nbytes -= entry.nbytes
        if isinstance(key, tuple) and self._file_keys.get((key[0], key[3])) == key:
            del self._file_keys[(key[0], key[3])]
