"""The talker's decode attention alone (``decode_attention_fresh``, real-size 1.7B shapes: 16 query heads, 8 kv
heads of 128) at B rows of ``--context`` keys, 28 layers' caches captured in one graph, against the floor of
reading each row's keys and values once. Variants of the kernel's knobs (keys a loop step, warps, pipeline
depth) are timed in one process.

    python tools/bench_attention.py --rows 64 --context 320 --variants 64/4/- 32/4/- 128/8/- 64/4/2
"""

from __future__ import annotations

import argparse
import json

import torch

from omniloop.gpu.kernels import decode_attention as da

from bench_talker import graph_of, time_ms

COPY_BYTES_PER_S = 4.26e12
LAYERS, HQ, HKV, D = 28, 16, 8, 128


@torch.no_grad()
def time_variant(rows: int, context: int, kv_bucket: int, iters: int) -> float:
    dev, dt = "cuda", torch.bfloat16
    caches = [(torch.randn(rows, HKV, kv_bucket + 1, D, device=dev, dtype=dt),
               torch.randn(rows, HKV, kv_bucket + 1, D, device=dev, dtype=dt)) for _ in range(LAYERS)]
    qkv = torch.randn(rows, 1, (HQ + 2 * HKV) * D, device=dev, dtype=dt)
    w = torch.ones(D, device=dev, dtype=dt)
    cos, sin = torch.randn(rows, D, device=dev, dtype=dt), torch.randn(rows, D, device=dev, dtype=dt)
    positions = torch.full((rows, 1), context - 1, dtype=torch.int64, device=dev)
    lengths = torch.full((rows,), context, dtype=torch.int64, device=dev)

    def step() -> None:
        for k, v in caches:
            da.decode_attention_fresh(qkv, HQ, HKV, w, w, 1e-6, cos, sin, k, v, positions, kv_bucket, lengths)

    return time_ms(graph_of(step).replay, iters) / LAYERS * 1e3  # us a layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, nargs="+", default=[320])
    ap.add_argument("--kv-bucket", type=int, default=512)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--variants", nargs="+", default=["64/4/-"],
                    help="keys a step/NUM_WARPS/NUM_STAGES ('-': Triton's default depth)")
    args = ap.parse_args()
    for context in args.context:
        floor_us = args.rows * context * HKV * D * 2 * 2 / COPY_BYTES_PER_S * 1e6
        for variant in args.variants:
            block, warps, stages = variant.split("/")
            da.BLOCK_N_MAX = da.BLOCK_N_FEW = int(block)  # forced, whatever the launch's size
            da.NUM_WARPS = int(warps)
            da.NUM_STAGES = None if stages == "-" else int(stages)
            us = time_variant(args.rows, context, args.kv_bucket, args.iters)
            print(json.dumps(dict(rows=args.rows, context=context, variant=variant, us_per_layer=round(us, 2),
                                  floor_us=round(floor_us, 2))), flush=True)


if __name__ == "__main__":
    main()
