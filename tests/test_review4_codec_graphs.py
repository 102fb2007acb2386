"""Review: once the codec's step graphs are captured up front (``warmup``), serving never captures another.

``decode_host`` splits a group larger than any captured graph into captured replays, but a chunk whose frame
bucket has no captured graph at all (a voice clone's first chunk: its reference frames ride in front of its
codes, e.g. 12 + 2 frames against warm-up up to ``chunking.frames`` = 8 on the CUDA profile) made
``_StepGraphs.replay`` capture a new graph mid-serving: a stall of the whole stage (cuDNN timing, capture) and
memory outside the budget that ``CodecMemoryBudget`` checked at start-up.

CUDA graphs are simulated on CPU: a "captured graph" here replays the eager step into its fixed output."""

from __future__ import annotations

import numpy as np
import torch

from omniloop.gpu.cuda_graphs import batch_buckets
from omniloop.models.qwen3_tts import speech_stream as ss
from omniloop.models.qwen3_tts.speech_tokenizer import SpeechTokenizer
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint


class _CpuGraph:
    def __init__(self, streams: ss.CodecStreams, inp: torch.Tensor, rows: int, frames: int) -> None:
        self.run = lambda: streams._run(*streams._split(inp, rows, frames))
        self.out = self.run().clone()

    def replay(self) -> None:
        self.out.copy_(self.run())


class _CpuStepGraphs(ss._StepGraphs):
    def __init__(self, streams: ss.CodecStreams, batch: tuple[int, ...]) -> None:  # no CUDA pool or stream
        self.streams, self.batch, self.graphs, self.limit = streams, batch, {}, 0
        self.captured: list[tuple[int, int]] = []

    def _capture(self, rows: int, frames: int):
        s = self.streams
        inp = torch.zeros(rows * frames * s.decoder.cfg.num_quantizers + 2 * rows, dtype=torch.int64)
        self.captured.append((rows, frames))
        graph = _CpuGraph(s, inp, rows, frames)
        return graph, inp, graph.out


def test_a_chunk_longer_than_the_warmed_up_frames_runs_without_a_capture_while_serving() -> None:
    dec = SpeechTokenizer.load(ensure_tiny_checkpoint("custom_voice"), device="cpu", dtype=torch.float64,
                               load_format="dummy", with_encoder=False, seed=3).decoder
    rng = np.random.default_rng(0)
    codes = {"clone": rng.integers(0, 2048, (12, 16), dtype=np.int64),  # reference frames + first codes
             "plain": rng.integers(0, 2048, (4, 16), dtype=np.int64)}
    pcm = {}
    for use_graphs in (True, False):
        streams = ss.CodecStreams(dec, max_streams=8, initial_slots=8, graphs=False)
        if use_graphs:
            streams._graphs = graphs = _CpuStepGraphs(streams, batch_buckets(8))
            num = streams.warmup(8, max_frames=4)  # the scheduler's chunks are at most 4 frames
            assert num == len(graphs.captured) > 0
        for r in codes:
            streams.open(r)
        pcm[use_graphs] = dict(zip(codes, streams.decode_host(list(codes.items()))))
        if use_graphs:
            assert graphs.captured[num:] == [], "a graph was captured while serving"
            assert streams.num_graphs == num
    for r, c in codes.items():
        assert pcm[True][r].shape == pcm[False][r].shape == (len(c) * 1920,)
        np.testing.assert_allclose(pcm[True][r], pcm[False][r], rtol=1e-9, atol=1e-12)
