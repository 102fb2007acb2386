"""Host cost of one talker step's output crossing to the codec stage: N plain chunks (codes [1, 16]) sent as N
``Chunk`` messages, or as one ``Chunks`` (``transport.batching``). Encode, ZMQ send and receive over ipc, decode
and split, on one thread: the loop-thread time both stages spend per step, GIL held.

    python tools/bench_transport.py --requests 64 --steps 300
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import zmq

from omniloop.transport import batching
from omniloop.transport.frames import decode, encode
from omniloop.transport.messages import Chunk, Chunks


def run(num_requests: int, num_steps: int, batched: bool) -> float:
    """Microseconds per step."""
    ctx = zmq.Context()
    address = f"ipc://{tempfile.mkdtemp()}/bench"
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(address)
    push.connect(address)
    chunks = [(Chunk(f"req-{i:04d}", 0, stage="talker"), {"codes": np.full((1, 16), i, np.int64)})
              for i in range(num_requests)]
    received = 0
    start = time.perf_counter()
    for _ in range(num_steps):
        if batched:
            push.send_multipart(encode(*batching.pack(chunks)), copy=False)
            msg, arrays = decode(pull.recv_multipart(copy=False))
            assert isinstance(msg, Chunks)
            received += sum(1 for _ in batching.unpack(msg, arrays))
        else:
            for msg, arrays in chunks:
                push.send_multipart(encode(msg, arrays), copy=False)
            for _ in chunks:
                decode(pull.recv_multipart(copy=False))
                received += 1
    elapsed = time.perf_counter() - start
    assert received == num_requests * num_steps
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()
    return elapsed / num_steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    for n in args.requests:
        row = {"requests": n, "messages_us_per_step": run(n, args.steps, False), "batched_us_per_step": run(n, args.steps, True)}
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
