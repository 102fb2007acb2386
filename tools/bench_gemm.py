"""The frame step's matmuls one by one, at decode batch sizes, against their weight-read floor (CUDA, bf16).

The talker's frame at 64 rows spends ~3.1 of its 5.2 ms of kernel time in cuBLASLt GEMMs with M = 64, about twice
the time it takes to read their weights (benchmarks/talker-steps.md). This says which of them are far from the
floor: each projection of the talker (x per frame: its layers) and of the code predictor (x layers x 15 steps),
timed as ``reps`` back-to-back calls replayed from one CUDA graph (so in-graph launch gaps count, as in the frame),
with the bytes it must read (weights + activations) and the achieved fraction of the 4.26 TB/s copy rate.

    python tools/bench_gemm.py --m 64 [--reps 50] [--out gemm.json]      # on the GPU
    python tools/bench_gemm.py --m 64 --kernels --parts 2 4              # + kernel names, K-split partials
    python tools/bench_gemm.py --dry-run                                  # the shapes and floors only (any machine)

A Triton matmul with the RMSNorm / SiLU*up / residual add fused in was swept against these cuBLAS calls at
4219e78 and lost (benchmarks/talker-steps.md, "Fused decode matmuls"); it was removed.
"""

from __future__ import annotations

import argparse
import json

import torch

from omniloop.models.qwen3_tts.config import load_tts_config
from omniloop.models.qwen3_tts.layers import linear_parts
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint

COPY_BYTES_PER_S = 4.26e12
L2_BYTES = 50 * 2**20


def frame_matmuls(size: str = "1.7b") -> list[dict]:
    """(name, N, K, calls per frame) of every projection a decode frame runs, from the released config."""
    cfg = load_tts_config(ensure_tiny_checkpoint("custom_voice", size=size))
    rows = []
    for part, dec, per_layer_calls in (("talker", cfg.talker.decoder, 1),
                                       ("cp", cfg.talker.code_predictor, cfg.talker.num_code_groups - 1)):
        h, d = dec.hidden_size, dec.head_dim
        calls = dec.num_layers * per_layer_calls
        rows += [dict(name=f"{part}.qkv", n=(dec.num_heads + 2 * dec.num_kv_heads) * d, k=h, calls=calls),
                 dict(name=f"{part}.o", n=h, k=dec.num_heads * d, calls=calls),
                 dict(name=f"{part}.gate_up", n=2 * dec.intermediate_size, k=h, calls=calls),
                 dict(name=f"{part}.down", n=h, k=dec.intermediate_size, calls=calls)]
    talker_h, cp = cfg.talker.decoder.hidden_size, cfg.talker.code_predictor
    rows.append(dict(name="talker.codec_head", n=cfg.talker.decoder.vocab_size, k=talker_h, calls=1))
    rows.append(dict(name="cp.lm_head", n=cp.vocab_size, k=cp.hidden_size, calls=cfg.talker.num_code_groups - 1))
    if cp.hidden_size != talker_h:  # the first step's two rows; later steps gather the projected input table
        rows.append(dict(name="cp.in_projection", n=cp.hidden_size, k=talker_h, calls=1))
    return rows


def floor_us(m: int, n: int, k: int, elem: int = 2) -> float:
    return (n * k + m * k + m * n) * elem / COPY_BYTES_PER_S * 1e6


def linear(x: torch.Tensor, w: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """``F.linear(x, w)``; with ``parts`` > 1, the product as ``parts`` float32 partial sums over slices of K
    (``layers.linear_parts``: what a norm kernel after the matmul sums, in place of cuBLAS's split-K reduce)."""
    return torch.nn.functional.linear(x, w) if parts == 1 else linear_parts(x, w, parts)


def kernels_of(m: int, n: int, k: int, parts: int = 1) -> list[str]:
    """The CUDA kernels one call launches (names cut to 70 characters): split-K shows as a reduce kernel."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    linear(x, w, parts)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        linear(x, w, parts)
        torch.cuda.synchronize()
    return [e.name[:70] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@torch.no_grad()
def time_us(m: int, n: int, k: int, reps: int, parts: int = 1) -> float:
    """µs per ``linear(x, w, parts)`` over ``reps`` calls replayed from one graph."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    # distinct weight copies, more bytes than the H200's 50 MB L2 together, used in turn: in the frame every
    # layer reads its own weights, so timing one weight over and over would read it from L2
    copies = min(reps, max(2, -(-L2_BYTES * 2 // (n * k * 2))))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in ws[:3]:
            linear(x, w, parts)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            linear(x, ws[i % copies], parts)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[64])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--size", default="1.7b")
    parser.add_argument("--dry-run", action="store_true", help="shapes and floors only")
    parser.add_argument("--kernels", action="store_true", help="also list each call's kernels (split-K shows)")
    parser.add_argument("--parts", type=int, nargs="*", default=[],
                        help="also time each shape as P float32 partial sums over K (one batched matmul)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run)")
    results = []
    for m in args.m:
        total_us = total_floor = 0.0
        for row in frame_matmuls(args.size):
            fl = floor_us(m, row["n"], row["k"])
            r = dict(row, m=m, floor_us=round(fl, 2))
            if not args.dry_run:
                us = time_us(m, row["n"], row["k"], args.reps)
                r.update(us=round(us, 2), of_floor=round(fl / us, 3))
                total_us += us * row["calls"]
                if args.kernels:
                    r["kernels"] = kernels_of(m, row["n"], row["k"])
                for parts in args.parts:
                    if row["k"] % parts == 0:
                        r[f"parts{parts}_us"] = round(time_us(m, row["n"], row["k"], args.reps, parts), 2)
            total_floor += fl * row["calls"]
            results.append(r)
            print(json.dumps(r), flush=True)
        summary = dict(m=m, per_frame_floor_ms=round(total_floor / 1e3, 3))
        if not args.dry_run:
            summary["per_frame_ms"] = round(total_us / 1e3, 3)
        print(json.dumps(summary), flush=True)
        results.append(summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if not args.dry_run else None,
                           torch=torch.__version__, reps=args.reps, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
