"""Host cost of one step's output crossing to the next actor: N plain chunks sent as N ``Chunk`` messages, or as
one ``Chunks`` (``transport.batching``). Encode, ZMQ send and receive, decode and split, on one thread: the
loop-thread time both ends spend per step, GIL held. ``--payload codes``: a talker step to the codec stage (codes
[1, 16] a request); ``--payload pcm``: a codec step to the frontend (``--frames`` x 1920 float32 samples a request).

    python tools/bench_transport.py --requests 64 --steps 300
    python tools/bench_transport.py --requests 64 --payload pcm --frames 8 --address inproc
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


def payload(kind: str, i: int, frames: int) -> dict[str, np.ndarray]:
    if kind == "pcm":
        return {"pcm": np.full(frames * 1920, i, np.float32)}
    return {"codes": np.full((1, 16), i, np.int64)}


def run(num_requests: int, num_steps: int, batched: bool, kind: str = "codes", frames: int = 8,
        transport: str = "ipc") -> float:
    """Microseconds per step."""
    ctx = zmq.Context()
    address = f"ipc://{tempfile.mkdtemp()}/bench" if transport == "ipc" else "inproc://bench"
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(address)
    push.connect(address)
    chunks = [(Chunk(f"req-{i:04d}", 0, stage="talker"), payload(kind, i, frames)) for i in range(num_requests)]
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
    parser.add_argument("--payload", choices=("codes", "pcm"), default="codes")
    parser.add_argument("--frames", type=int, default=8, help="--payload pcm: frames of audio a request")
    parser.add_argument("--address", choices=("ipc", "inproc"), default="ipc")
    args = parser.parse_args()
    for n in args.requests:
        common = (args.payload, args.frames, args.address)
        row = {"requests": n, "payload": args.payload, "address": args.address,
               "messages_us_per_step": run(n, args.steps, False, *common),
               "batched_us_per_step": run(n, args.steps, True, *common)}
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
