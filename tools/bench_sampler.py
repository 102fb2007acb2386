"""The fused sampler (``gpu/kernels/sampler.py``) alone: microseconds per ``sample_rows`` launch.

Per vocabulary size and row mix: ``--calls`` launches captured in one CUDA graph, replayed ``--iters`` times
between two CUDA events (after one warm-up replay), so the time is the kernels' and not Python's.

    python tools/bench_sampler.py --batch 64 --vocab 2048 3072 [--out benchmarks/sampler.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from omniloop.gpu.kernels.sampler import sample_rows
from omniloop.models.qwen3_tts.sampling import gumbel_noise

# name -> (do_sample, temperature, top_k, top_p); "typical" is the Qwen3-TTS default request
MIXES = {
    "typical": (True, 0.9, 50, 1.0),
    "top_p": (True, 0.9, 50, 0.8),
    "top_p_only": (True, 0.9, 0, 0.8),
    "no_filter": (True, 0.9, 0, 1.0),
    "greedy": (False, 1.0, 0, 1.0),
}


def rows(batch: int, vocab: int, mix: str) -> dict[str, torch.Tensor]:
    do_sample, temperature, top_k, top_p = MIXES[mix]
    gen = torch.Generator(device="cuda").manual_seed(0)
    return dict(logits=torch.randn(batch, vocab, device="cuda", generator=gen) * 3,
                do_sample=torch.full((batch,), do_sample, device="cuda"),
                temperature=torch.full((batch,), temperature, device="cuda"),
                top_k=torch.full((batch,), top_k, dtype=torch.int64, device="cuda"),
                top_p=torch.full((batch,), top_p, device="cuda"),
                noise=gumbel_noise(torch.rand(batch, vocab, device="cuda", generator=gen)))


def time_us(args: dict[str, torch.Tensor], calls: int, iters: int) -> float:
    """Microseconds per launch, from graph replays of ``calls`` launches."""
    sample_rows(**args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            sample_rows(**args)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument("--vocab", type=int, nargs="+", default=[2048, 3072])
    parser.add_argument("--mix", nargs="+", choices=sorted(MIXES), default=list(MIXES))
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    results = []
    for batch in args.batch:
        for vocab in args.vocab:
            for mix in args.mix:
                results.append(dict(batch=batch, vocab=vocab, mix=mix,
                                    us_per_call=round(time_us(rows(batch, vocab, mix), args.calls, args.iters), 2)))
                print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
