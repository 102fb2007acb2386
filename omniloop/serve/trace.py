"""``omniloop trace``: a short benchmark run with tracing on, merged into one Chrome/Perfetto trace.

Every actor (frontend and stages, threads or processes) records its steps and requests while
``OMNILOOP_TRACE_DIR`` is set; this command sets it to a fresh folder, runs the load, merges the
files into ``--out`` and prints per stage: step counts, mean / p95 step time, the median pace,
the busy fraction and the longest steps (``actors.trace.summarize``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from omniloop.actors.trace import ENV_DIR, merge_traces, summarize
from omniloop.serve.serve_cmd import profile_from_args


def main(args: argparse.Namespace) -> int:
    import uvloop

    from omniloop.serve.bench import run_bench

    profile = profile_from_args(args)
    with tempfile.TemporaryDirectory(prefix="omniloop-trace-") as folder:
        os.environ[ENV_DIR] = folder  # read by every actor this process starts, spawned ones included
        try:
            uvloop.run(run_bench(profile, [args.concurrency], args.num_requests, args.text_words, args.max_frames))
        finally:
            del os.environ[ENV_DIR]
        trace = merge_traces(folder, args.out)
    summary = summarize(trace)
    print(json.dumps({"trace": args.out, "num_events": len(trace["traceEvents"]), "stages": summary}, indent=2))
    return 0
