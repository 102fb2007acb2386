"""Does splitting the decode frame's rows over concurrent streams pay? (real-size 1.7B shapes, random weights)

The frame at 64 rows is latency-bound (~1,050 small kernels, the code predictor's GEMMs at ~30 % of the
bandwidth floor), so one kernel at a time leaves SMs idle. Here the same 64 rows run as ``--split`` groups, each
its own ``TalkerState`` and captured frame graph, replayed on its own stream, so their kernels may share the
GPU. Prints ms per frame (all rows) for the whole batch on one stream and for each split.

    python tools/bench_split.py --rows 64 --split 1 2 4 --context 320
"""

from __future__ import annotations

import argparse
import json

import torch

from omniloop.gpu.backends import configure_cuda_stage
from omniloop.gpu.cuda_graphs import capture

from bench_talker import random_model, sampled_state


@torch.no_grad()
def split_ms(model, rows: int, groups: int, context: int, iters: int, priorities: bool) -> float:
    per = rows // groups
    states = [sampled_state(model, per, context) for _ in range(groups)]
    streams = [torch.cuda.Stream(priority=-(i % 2) if priorities else 0) for i in range(groups)]
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for state, stream in zip(states, streams):
        state.active[:per] = True
        state.positions[:per] = context - 1  # every row reads the whole bucket
        graphs.append(capture(lambda s=state: s.decode_frame(per, context), stream, pool)[0])
    torch.cuda.synchronize()
    main = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for it in range(iters + 3):
        if it == 3:
            start.record(main)
        for g, s in zip(graphs, streams):
            s.wait_stream(main)  # a frame of every group starts together (the runner's step boundary)
            with torch.cuda.stream(s):
                g.replay()
        for s in streams:
            main.wait_stream(s)
    end.record(main)
    end.synchronize()
    model.cache = None
    del graphs, states
    torch.cuda.empty_cache()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--split", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    configure_cuda_stage()
    model = random_model()
    for groups in args.split:
        for prio in ([False, True] if groups > 1 else [False]):
            ms = split_ms(model, args.rows, groups, args.context, args.iters, prio)
            print(json.dumps(dict(rows=args.rows, groups=groups, context=args.context, alternate_priority=prio,
                                  frame_ms=round(ms, 3))), flush=True)


if __name__ == "__main__":
    main()
