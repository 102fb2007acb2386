"""Codec-stage step times on the real-size Qwen3-TTS-1.7B speech decoder (random weights, CUDA).

Per (streams, chunk frames): ``CodecStreams`` steady state (every stream already open and warm), timed as the
codec runner sees it: one batched decode plus the PCM on the host (``decode_host``; for a tree without it,
``decode`` then ``.cpu()`` per row, as the runner used to). Reports ms per step and audio-s/s; ``--profile``
adds torch.profiler's top kernels and the CPU time of one step; ``--convs`` times the conv shapes alone.

    python tools/bench_codec.py --batches 1 16 64 --chunks 1 4 8 25 [--eager] [--cudnn-heuristics] [--profile 64x8]
        [--channels-last | --no-channels-last]
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import numpy as np
import torch

import omniloop
from omniloop.models.qwen3_tts.speech_stream import CodecStreams
from omniloop.models.qwen3_tts.speech_tokenizer import SpeechTokenizer
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint

SAMPLES_PER_FRAME, SAMPLE_RATE = 1920, 24000


def build_streams(decoder, num: int, eager: bool) -> CodecStreams:
    kw = {"graphs": not eager} if "graphs" in inspect.signature(CodecStreams).parameters else {}
    streams = CodecStreams(decoder, max_streams=num, initial_slots=num, **kw)
    for i in range(num):
        streams.open(f"r{i}")
    return streams


def host_step(streams: CodecStreams, chunks: list) -> list[np.ndarray]:
    if hasattr(streams, "decode_host"):
        return streams.decode_host(chunks)
    return [p.float().cpu().numpy() for p in streams.decode(chunks)]


def time_steps(streams: CodecStreams, num: int, frames: int, steps: int, warm: int = 3) -> float:
    rng = np.random.default_rng(0)
    chunks = [(f"r{i}", rng.integers(0, 2048, (frames, 16), dtype=np.int64)) for i in range(num)]
    for _ in range(warm):
        host_step(streams, chunks)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        out = host_step(streams, chunks)
    torch.cuda.synchronize()
    assert out[0].shape == (frames * SAMPLES_PER_FRAME,) and np.isfinite(out[0]).all()
    return (time.perf_counter() - t) * 1e3 / steps


def profile_step(streams: CodecStreams, num: int, frames: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    rng = np.random.default_rng(1)
    chunks = [(f"r{i}", rng.integers(0, 2048, (frames, 16), dtype=np.int64)) for i in range(num)]
    for _ in range(3):
        host_step(streams, chunks)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(5):
            host_step(streams, chunks)
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / 5
    print(f"profile B={num} L={frames}: GPU kernel time {gpu_us / 1e3:.2f} ms/step, "
          f"{sum(e.count for e in events if e.self_device_time_total > 0) / 5:.0f} kernel launches/step")
    print(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=110))
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
    ops.sort(key=lambda e: -e.device_time_total)
    for e in ops[:40]:  # which torch ops (and shapes) the kernel time belongs to
        print(f"  {e.device_time_total / 5e3:7.3f} ms/step  x{e.count // 5:<3d} {e.key} {str(e.input_shapes)[:110]}")


def bench_convs(batch: int, frames: int, dtype: torch.dtype) -> None:
    """Each residual conv shape of the decoder at a chunk of ``frames`` (NCL conv1d vs channels-last conv2d)."""
    shapes = [(1536, 1536, 7, 1, 4 * frames), (768, 768, 7, 9, 32 * frames), (384, 384, 7, 9, 160 * frames),
              (192, 192, 7, 9, 640 * frames), (96, 96, 7, 9, 1920 * frames), (1024, 1536, 7, 1, 4 * frames)]
    for bench in (False, True):
        torch.backends.cudnn.benchmark = bench
        for cin, cout, k, d, n in shapes:
            x = torch.randn(batch, cin, n + (k - 1) * d, device="cuda", dtype=dtype)
            w = torch.randn(cout, cin, k, device="cuda", dtype=dtype) / (cin * k) ** 0.5
            x4 = x[:, :, None].contiguous(memory_format=torch.channels_last)
            w4 = w[:, :, None].contiguous(memory_format=torch.channels_last)
            ms = [_event_ms(lambda: torch.nn.functional.conv1d(x, w, dilation=d)),
                  _event_ms(lambda: torch.nn.functional.conv2d(x4, w4, dilation=(1, d)))]
            flop = 2 * batch * cin * cout * k * n
            print(f"conv cudnn.benchmark={bench} B={batch} {cin}->{cout} k{k} d{d} n={n}: ncl {ms[0]:.3f} ms "
                  f"({flop / ms[0] / 1e9:.0f} TFLOP/s) | nhwc {ms[1]:.3f} ms ({flop / ms[1] / 1e9:.0f} TFLOP/s)")
    torch.backends.cudnn.benchmark = False


def _event_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 8, 25])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (where the tree has them)")
    ap.add_argument("--cudnn-heuristics", action="store_true",
                    help="leave torch.backends.cudnn.benchmark off (the codec stage turns it on)")
    ap.add_argument("--profile", default="", help="BxL, e.g. 64x8")
    ap.add_argument("--convs", action="store_true")
    ap.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                    help="the decoder's conv layout (default: the tree's default, channels-last on CUDA where "
                         "the tree has it)")
    ap.add_argument("--no-fold-bias", action="store_true",
                    help="the residual units' conv biases and residual adds as separate passes "
                         "(speech_layers.FOLD_CONV_BIAS off)")
    ap.add_argument("--no-fused-transformer", action="store_true",
                    help="the transformer's norms, residual adds and RoPE as torch ops "
                         "(speech_decoder.FUSED_TRANSFORMER off)")
    ap.add_argument("--json", default="")
    ap.add_argument("--warmup", type=int, nargs="*",
                    help="only: capture every graph bucket up to rows x frames <= N (each N in a fresh pool), "
                         "reporting graphs, seconds and reserved GiB")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.no_fold_bias:
        from omniloop.models.qwen3_tts import speech_layers

        speech_layers.FOLD_CONV_BIAS = False
    if args.no_fused_transformer:
        from omniloop.models.qwen3_tts import speech_decoder

        speech_decoder.FUSED_TRANSFORMER = False
    torch.backends.cudnn.benchmark = not args.cudnn_heuristics
    if args.convs:
        bench_convs(64, 8, dtype)
    layout = {}
    if args.channels_last is not None:
        if "channels_last" not in inspect.signature(SpeechTokenizer.load).parameters:
            raise SystemExit("this tree's decoder has no channels-last layout")
        layout = {"channels_last": args.channels_last}
    tok = SpeechTokenizer.load(ensure_tiny_checkpoint("custom_voice", size="1.7b"), device="cuda", dtype=dtype,
                               load_format="dummy", with_encoder=False, **layout)
    print(f"omniloop from {omniloop.__file__}; {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.dtype}, eager={args.eager}, cudnn.benchmark={not args.cudnn_heuristics}, "
          f"channels_last={getattr(tok.decoder, 'channels_last', False)}")
    rows = []
    if args.warmup:
        for limit in args.warmup:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_reserved()
            streams = build_streams(tok.decoder, max(args.batches), args.eager)
            t = time.perf_counter()
            num = streams.warmup(limit)
            torch.cuda.synchronize()
            row = dict(rows_x_frames=limit, graphs=num, seconds=round(time.perf_counter() - t, 1),
                       reserved_gib=round((torch.cuda.memory_reserved() - base) / 2**30, 2))
            for b, f in ((64, 1), (64, 4), (64, 8), (32, 8), (64, 16), (64, 25)):
                if b <= max(args.batches):
                    row[f"{b}x{f}_ms"] = round(time_steps(streams, b, f, args.steps), 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del streams
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        return
    for num in args.batches:
        streams = build_streams(tok.decoder, num, args.eager)
        for frames in args.chunks:
            ms = time_steps(streams, num, frames, args.steps)
            audio_s = num * frames * SAMPLES_PER_FRAME / SAMPLE_RATE
            rows.append(dict(streams=num, frames=frames, ms=round(ms, 3), audio_s_per_s=round(audio_s / ms * 1e3)))
            print(f"B={num:3d} chunk={frames:2d} frames: {ms:8.2f} ms/step  {audio_s / ms * 1e3:8.0f} audio-s/s  "
                  f"graphs={getattr(streams, 'num_graphs', 0)}", flush=True)
        if args.profile and args.profile == f"{num}x{args.profile.split('x')[1]}":
            profile_step(streams, num, int(args.profile.split("x")[1]))
        del streams
        torch.cuda.empty_cache()
    print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
