"""Do the talker's frames and the codec's steps overlap on one GPU?

At 64 streams a wave's GPU time is the plain sum of the talker's frames (~100 x 5.4 ms), its admission plans
and the codec's steps (~12.5 x 13.7 ms): the talker's stream has the device's highest priority, yet its short,
launch-bound kernels wait behind the codec's long conv kernels for SMs (benchmarks/pipeline.md). This times,
on the real-size Qwen3-TTS-1.7B talker and speech decoder (random weights, bf16, CUDA graphs as the stages
run them):

- the talker alone: ``--frames`` frame replays at 64 rows (high-priority stream, as ``TalkerRunner``);
- the codec alone: ``--frames / 8`` steps of 64 streams x 8 frames (what those frames feed the codec);
- both at once from two threads, the codec on a normal-priority stream (as the stages run).

Each line is JSON: wall ms of the mode, and for the overlapped one the serial sum and the share of it saved.
(Confining the codec to part of the SMs with a CUDA green context was measured and dropped: cuDNN falls back
to a grouped direct kernel there, 454 ms a step on 100 SMs; benchmarks/pipeline.md.)

    python tools/bench_overlap.py --frames 96 [--codec-eager] [--out overlap.json]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np
import torch

from omniloop.gpu.backends import configure_cuda_stage
from omniloop.gpu.cuda_graphs import FrameGraphs
from omniloop.gpu.talker_runner import HIGH_PRIORITY
from omniloop.gpu.talker_state import TalkerState
from omniloop.models.qwen3_tts.speech_stream import CodecStreams
from omniloop.models.qwen3_tts.speech_tokenizer import SpeechTokenizer
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint
from tools.bench_talker import random_model, sampled_state

ROWS, CONTEXT, CHUNK = 64, 256, 8


def build_talker(device: torch.device) -> tuple[FrameGraphs, TalkerState, torch.cuda.Stream]:
    """The graphs do not hold the state they were captured on: the caller keeps ``state`` (and so the model)
    alive, or the replays read freed memory."""
    state = sampled_state(random_model(device), ROWS, CONTEXT)
    stream = torch.cuda.Stream(device, priority=HIGH_PRIORITY)
    with torch.cuda.stream(stream), torch.no_grad():
        graphs = FrameGraphs(state, stream, (ROWS,), (CONTEXT,))  # captures with every row idle
    state.active[:] = True
    state.positions[:] = CONTEXT - 1  # every row reads the whole bucket: CONTEXT keys
    stream.synchronize()
    return graphs, state, stream


def build_codec(device: torch.device, eager: bool) -> CodecStreams:
    tok = SpeechTokenizer.load(ensure_tiny_checkpoint("custom_voice", size="1.7b"), device=str(device),
                               dtype=torch.bfloat16, load_format="dummy", with_encoder=False)
    streams = CodecStreams(tok.decoder, max_streams=ROWS, initial_slots=ROWS, graphs=not eager)
    for i in range(ROWS):
        streams.open(f"r{i}")
    return streams


def talker_loop(graphs: FrameGraphs, stream: torch.cuda.Stream, frames: int) -> None:
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(frames):
            graphs.replay(ROWS, CONTEXT)
    stream.synchronize()


def codec_loop(streams: CodecStreams, stream: torch.cuda.Stream, steps: int, chunks: list) -> None:
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(steps):
            streams.decode_host(chunks)  # waits for its PCM, as the codec runner's thread does


def timed(*jobs) -> float:  # noqa: ANN002
    """Wall ms of running ``jobs`` (callables) each on its own thread, started together."""
    torch.cuda.synchronize()
    threads = [threading.Thread(target=job) for job in jobs]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=96, help="talker frames; the codec runs frames / 8 steps")
    parser.add_argument("--codec-eager", action="store_true", help="the codec without CUDA graphs")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    configure_cuda_stage()
    torch.backends.cudnn.benchmark = True  # as the codec stage's profile sets it
    graphs, state, talker_stream = build_talker(device)  # state: kept alive for the replays
    rng = np.random.default_rng(0)
    chunks = [(f"r{i}", rng.integers(0, 2048, (CHUNK, 16), dtype=np.int64)) for i in range(ROWS)]
    steps = max(1, args.frames // CHUNK)
    codec_stream = torch.cuda.Stream(device)
    codec = build_codec(device, args.codec_eager)
    codec_loop(codec, codec_stream, 2, chunks)
    talker_loop(graphs, talker_stream, 5)
    rows = []

    def best(fn) -> float:  # noqa: ANN001
        return min(fn() for _ in range(args.repeat))

    talker_ms = best(lambda: timed(lambda: talker_loop(graphs, talker_stream, args.frames)))
    rows.append(dict(mode="talker alone", frames=args.frames, wall_ms=talker_ms,
                     frame_ms=talker_ms / args.frames))
    codec_ms = best(lambda: timed(lambda: codec_loop(codec, codec_stream, steps, chunks)))
    rows.append(dict(mode="codec alone", steps=steps, wall_ms=codec_ms, step_ms=codec_ms / steps))
    ms = best(lambda: timed(lambda: talker_loop(graphs, talker_stream, args.frames),
                            lambda: codec_loop(codec, codec_stream, steps, chunks)))
    serial = talker_ms + codec_ms  # the two one after the other
    rows.append(dict(mode="both", frames=args.frames, steps=steps, wall_ms=ms, serial_ms=serial,
                     saved=1 - ms / serial))
    for row in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
