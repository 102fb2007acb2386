"""Message <-> multipart frames: ``[kind byte][msgpack header][buffer 0][buffer 1]...``.

Arrays never pass through msgpack: each is one out-of-band frame, described in the header's
``arrays`` field by a ``TensorMeta(dtype, shape, index)``. Encoding hands out memoryviews of the
caller's arrays (zero copy; the caller must not mutate them until the send completes, which for
ZMQ with ``copy=False`` means until the message left the process). Decoding returns read-only numpy
views over the received buffers. Nothing here pickles, and every malformed input raises
``FrameError`` (with the request id when the header was readable that far).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from omniloop.errors import FrameError
from omniloop.transport.messages import KIND_OF, TYPE_OF, Kind, Message, TensorMeta

__all__ = ["ALLOWED_DTYPES", "FrameError", "decode", "encode", "peek_kind"]

# Only plain numeric dtypes may cross a socket: object/void/str dtypes could smuggle pointers or
# unbounded parsing work. bfloat16 has no numpy dtype; runners send it as a uint16 view.
ALLOWED_DTYPES = frozenset(
    {
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
    }
)
_MAX_NDIM = 32  # numpy's limit is 32 (1.x) or 64 (2.x); no omniloop array has more than a few
_NATIVE_ORDER = "<" if sys.byteorder == "little" else ">"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_raw_decoder = msgspec.msgpack.Decoder()

Buffer = bytes | bytearray | memoryview


def encode(msg: Message, arrays: dict[str, np.ndarray] | None = None) -> list[Buffer]:
    """Frames for ``msg`` with ``arrays`` riding out of band. A message type without an ``arrays``
    field cannot carry arrays (ValueError); non-contiguous arrays are copied once to C order."""
    kind = KIND_OF.get(type(msg))
    if kind is None:
        raise TypeError(f"cannot encode {type(msg).__name__}: not a transport message type")
    buffers: list[Buffer] = []
    if arrays:
        if not hasattr(msg, "arrays"):
            raise ValueError(f"{type(msg).__name__} has no 'arrays' field; it cannot carry {sorted(arrays)}")
        metas = {}
        for index, (name, array) in enumerate(arrays.items()):
            array = _checked(name, array)
            metas[name] = TensorMeta(array.dtype.name, tuple(array.shape), index)
            buffers.append(memoryview(array.reshape(-1).view(np.uint8)))
        msg = msgspec.structs.replace(msg, arrays=metas)
    elif getattr(msg, "arrays", None):
        msg = msgspec.structs.replace(msg, arrays={})
    return [bytes((kind,)), _encoder.encode(msg), *buffers]


def peek_kind(frames: Sequence[Any]) -> Kind:
    """The message kind from the first frame alone, for routing without decoding."""
    if not frames:
        raise FrameError("empty message: no frames")
    first = _as_bytes(frames[0])
    if len(first) != 1 or first[0] not in TYPE_OF:
        raise FrameError(f"bad kind frame {first[:8]!r}: expected one byte in {sorted(TYPE_OF)}")
    return Kind(first[0])


def decode(frames: Sequence[Any]) -> tuple[Message, dict[str, np.ndarray]]:
    """``(msg, arrays)`` from frames (bytes, memoryviews or zmq.Frame). Arrays are read-only views."""
    kind = peek_kind(frames)
    if len(frames) < 2:
        raise FrameError(f"truncated {kind.name} message: no header frame")
    header = _as_buffer(frames[1])
    try:
        msg = _decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"bad {kind.name} header: {exc}", *_req_ids_of(header)) from None
    req_ids = getattr(msg, "req_ids", None)
    if req_ids is not None:  # a batch: a damaged frame fails every request it carries
        try:
            return _decode_checked(kind, msg, frames, None)
        except FrameError as exc:
            raise FrameError(str(exc), req_ids=req_ids) from None
    return _decode_checked(kind, msg, frames, getattr(msg, "req_id", None))


def _decode_checked(kind: Kind, msg: Message, frames: Sequence[Any], req_id: str | None,
                    ) -> tuple[Message, dict[str, np.ndarray]]:
    if KIND_OF[type(msg)] != kind:
        raise FrameError(f"kind byte says {kind.name} but header is {type(msg).__name__}", req_id)
    metas: dict[str, TensorMeta] = getattr(msg, "arrays", None) or {}
    num_buffers = len(frames) - 2
    if sorted(m.index for m in metas.values()) != list(range(num_buffers)):
        raise FrameError(
            f"{kind.name} header describes buffers {sorted(m.index for m in metas.values())} "
            f"but {num_buffers} buffer frames arrived (truncated or padded message)",
            req_id,
        )
    return msg, {name: _array(name, meta, frames[2 + meta.index], req_id) for name, meta in metas.items()}


def _checked(name: str, array: np.ndarray) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"array {name!r} is a {type(array).__name__}, expected numpy.ndarray")
    if array.dtype.name not in ALLOWED_DTYPES:
        raise TypeError(f"array {name!r} has dtype {array.dtype}, allowed: {sorted(ALLOWED_DTYPES)}")
    if array.dtype.byteorder not in ("=", "|", _NATIVE_ORDER):
        array = array.astype(array.dtype.newbyteorder("="))
    # ascontiguousarray would also turn a 0-d array into shape (1,); only copy what needs it.
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _array(name: str, meta: TensorMeta, frame: Any, req_id: str | None) -> np.ndarray:
    if meta.dtype not in ALLOWED_DTYPES:
        raise FrameError(f"array {name!r} has dtype {meta.dtype!r}, not in the allowlist", req_id)
    if any(d < 0 for d in meta.shape):
        raise FrameError(f"array {name!r} has negative shape {meta.shape}", req_id)
    if len(meta.shape) > _MAX_NDIM:
        raise FrameError(f"array {name!r} has {len(meta.shape)} dimensions, at most {_MAX_NDIM} allowed", req_id)
    dtype = np.dtype(meta.dtype)
    buffer = _as_buffer(frame)
    # Python ints: an int64 product would wrap for hostile shapes and match an empty frame.
    expected = math.prod(meta.shape) * dtype.itemsize
    if buffer.nbytes != expected:
        raise FrameError(
            f"array {name!r} {meta.dtype}{list(meta.shape)} needs {expected} bytes, frame has {buffer.nbytes}",
            req_id,
        )
    try:
        return np.frombuffer(buffer, dtype=dtype).reshape(meta.shape)
    except ValueError as exc:  # e.g. a zero-size array whose other dims overflow numpy's intp
        raise FrameError(f"array {name!r} {meta.dtype}{list(meta.shape)}: {exc}", req_id) from None


def _as_buffer(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", None)  # zmq.Frame exposes its bytes without a copy here
    return buffer if buffer is not None else memoryview(frame)


def _as_bytes(frame: Any) -> bytes:
    data = getattr(frame, "bytes", None)
    return data if data is not None else bytes(frame)


def _req_ids_of(header: memoryview) -> tuple[str | None, list[str]]:
    """Best effort: the request id (or a batch's ids) from a header that failed typed decoding."""
    try:
        raw = _raw_decoder.decode(header)
    except msgspec.DecodeError:
        return None, []
    if not isinstance(raw, dict):
        return None, []
    req_id, req_ids = raw.get("req_id"), raw.get("req_ids")
    ids = [r for r in req_ids if isinstance(r, str)] if isinstance(req_ids, list) else []
    return (req_id if isinstance(req_id, str) else None), ids
