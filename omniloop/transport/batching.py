"""Coalescing a step's plain chunks into one ``Chunks`` message, and splitting it again on arrival.

A run of consecutive chunks to the same peer travels as one message when each chunk is plain (not final,
no text) and carries the same array names, dtypes and trailing shapes as the run's first, every array of a
chunk having the same number of rows. Anything else (a final chunk, a Finish, an Abort) ends the run, and
the run is sent first: messages of one request keep their order on the socket.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from omniloop.errors import FrameError
from omniloop.transport.messages import Chunk, Chunks

Arrays = dict[str, np.ndarray]


def layout(msg: object, arrays: Arrays | None) -> tuple | None:
    """What chunks must share to ride in one ``Chunks``; None: this one travels alone."""
    if type(msg) is not Chunk or msg.final or msg.reason is not None or msg.text is not None or not arrays:
        return None
    rows = {a.shape[0] if a.ndim else -1 for a in arrays.values()}
    if len(rows) != 1 or -1 in rows:
        return None
    return msg.stage, tuple((name, a.dtype.str, a.shape[1:]) for name, a in arrays.items())


def pack(chunks: list[tuple[Chunk, Arrays]]) -> tuple[Chunks, Arrays]:
    """One message for chunks of one ``layout`` (the caller groups them)."""
    first_msg, first_arrays = chunks[0]
    batch = Chunks(req_ids=[m.req_id for m, _ in chunks], seqs=[m.seq for m, _ in chunks],
                   rows=[next(iter(a.values())).shape[0] for _, a in chunks], stage=first_msg.stage)
    arrays = {name: np.concatenate([a[name] for _, a in chunks]) for name in first_arrays}
    return batch, arrays


def unpack(batch: Chunks, arrays: Arrays) -> Iterator[tuple[Chunk, Arrays]]:
    """The chunks of ``batch`` in order, their arrays as views of the received ones. Checked whole before the
    first is yielded: a malformed batch is a FrameError naming every request of the batch (``req_ids``: each
    is failed), and no chunk of it is delivered."""
    n = len(batch.req_ids)
    if len(batch.seqs) != n or len(batch.rows) != n:
        raise FrameError(f"Chunks with {n} request ids, {len(batch.seqs)} seqs and {len(batch.rows)} row counts",
                         req_ids=batch.req_ids)
    if not arrays or any(r < 0 for r in batch.rows):
        raise FrameError("Chunks without arrays, or with a negative row count", req_ids=batch.req_ids)
    total = sum(batch.rows)
    for name, a in arrays.items():
        if a.ndim == 0 or a.shape[0] != total:
            raise FrameError(f"Chunks array {name!r} has shape {list(a.shape)}, the row counts add up to {total}",
                             req_ids=batch.req_ids)
    return _split(batch, arrays)


def _split(batch: Chunks, arrays: Arrays) -> Iterator[tuple[Chunk, Arrays]]:
    start = 0
    for req_id, seq, rows in zip(batch.req_ids, batch.seqs, batch.rows):
        yield Chunk(req_id=req_id, seq=seq, stage=batch.stage), {k: a[start:start + rows] for k, a in arrays.items()}
        start += rows
