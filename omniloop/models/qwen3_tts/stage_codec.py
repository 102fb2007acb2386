"""The Qwen3-TTS codec stage: ``CodecScheduler`` + a runner over the stateful streaming decoder.

Each step decodes the planned frames of many requests in one batched call; every request keeps its
decoder state (sliding-window cache, causal-conv tails) in a ``CodecStreams`` slot, so each frame is
decoded exactly once and the stream equals the one-shot decode.

The step runs on the runner's worker thread (``CpuRunner``): on a GPU, the thread replays the step's
CUDA graph and waits for the one PCM copy, so the event loop never does. A request's stream is opened at its first
chunk and closed at its last; a request aborted mid-stream is closed when its scheduler slot is reused
(the scheduler frees slots at once on abort, and a slot's next request always starts with ``is_first``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from omniloop.gpu.runner import CpuRunner
from omniloop.log import get_logger
from omniloop.models.qwen3_tts.family import resolve_checkpoint
from omniloop.models.qwen3_tts.speech_stream import CodecStreams
from omniloop.models.qwen3_tts.speech_tokenizer import SpeechTokenizer
from omniloop.models.registry import Worker
from omniloop.scheduler.codec import CodecConfig, CodecScheduler
from omniloop.scheduler.plan import CodecStepPlan, CodecStepResult

SAMPLES_PER_FRAME = 1920
log = get_logger(__name__)


class CodecRunner(CpuRunner):
    def __init__(self, streams: CodecStreams, name: str = "codec") -> None:
        super().__init__(name)
        self.streams = streams
        # its own stream at normal priority (below the talker's): in a shared process the talker's kernels go
        # first, and nothing waits on the legacy default stream
        self._stream = None
        self._device = streams.device
        if self._device.type == "cuda":
            self._stream = torch.cuda.Stream(self._device)
            self._stream.wait_stream(torch.cuda.current_stream(self._device))  # the warm-up's writes first
        self._owner: dict[int, str] = {}  # scheduler slot -> req_id whose stream is open there

    @torch.inference_mode()
    def step(self, plan: CodecStepPlan) -> CodecStepResult:
        if self._stream is None:
            return self._step(plan)
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            return self._step(plan)

    def _step(self, plan: CodecStepPlan) -> CodecStepResult:
        for seq in plan.seqs:
            if seq.is_first:
                stale = self._owner.pop(seq.slot, None)
                if stale is not None:
                    self.streams.close(stale)
                # an id used again after an abort may still own a stream in another slot
                for slot in [s for s, owner in self._owner.items() if owner == seq.req_id]:
                    del self._owner[slot]
                self.streams.close(seq.req_id)
                self.streams.open(seq.req_id)
                self._owner[seq.slot] = seq.req_id
        # one device-to-host copy of the whole step into pinned memory, one wait
        pcm = self.streams.decode_host([(seq.req_id, seq.codes) for seq in plan.seqs])
        # context rows (a clone's reference frames) prime the state; their samples are not the request's
        out = [np.asarray(p[seq.num_context * SAMPLES_PER_FRAME:], dtype=np.float32)
               for p, seq in zip(pcm, plan.seqs)]
        for seq in plan.seqs:
            if seq.is_last:
                self.streams.close(seq.req_id)
                self._owner.pop(seq.slot, None)
        return CodecStepResult(pcm=out)

    def close(self) -> None:
        try:
            super().close()
        finally:
            for req_id in self._owner.values():
                self.streams.close(req_id)
            self._owner.clear()


class CodecMemoryBudget:
    """The codec stage's share of its GPU: ``gpu_memory_fraction`` x total memory, against what this stage
    reserved since it started building (weights, decoder state, captured graphs; stages are built one at a
    time, so the difference is this stage's even when stages share a process). Checked after each graph
    capture, so an over-large warm-up stops with the numbers instead of running the device out of memory."""

    def __init__(self, stage: str, device: str, fraction: float, warmup_rows_x_frames: int) -> None:
        self.stage, self.device, self.warmup = stage, torch.device(device), warmup_rows_x_frames
        self.fraction = fraction
        self.total = torch.cuda.get_device_properties(self.device).total_memory
        self.base = torch.cuda.memory_reserved(self.device)

    @property
    def budget_bytes(self) -> int:
        return int(self.fraction * self.total)

    def check(self, num_graphs: int) -> None:
        used = torch.cuda.memory_reserved(self.device) - self.base
        if used > self.budget_bytes:
            gib = 2**30
            raise ValueError(
                f"stage {self.stage!r}: the codec holds {used / gib:.1f} GiB (weights, decoder state and "
                f"{num_graphs} captured step graphs) > its budget, gpu_memory_fraction {self.fraction} x "
                f"{self.total / gib:.1f} GiB = {self.budget_bytes / gib:.1f} GiB. Lower options.warmup_rows_x_frames "
                f"(now {self.warmup}), chunking.frames or max_num_seqs, or raise gpu_memory_fraction")


def build_codec(stage: Any, profile: Any) -> Worker:
    ckpt = resolve_checkpoint(profile)
    opts = dict(stage.options)
    cudnn_benchmark = bool(opts.pop("cudnn_benchmark", False))
    warmup_frames = int(opts.pop("warmup_rows_x_frames", 256))
    if opts:
        raise ValueError(f"stage {stage.name!r}: unknown options {sorted(opts)} for qwen3_tts.codec "
                         "(known: cudnn_benchmark, warmup_rows_x_frames)")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[stage.dtype]
    is_cuda = torch.device(stage.device).type == "cuda"
    budget = None
    if is_cuda and stage.gpu_memory_fraction is not None:
        budget = CodecMemoryBudget(stage.name, stage.device, stage.gpu_memory_fraction, warmup_frames)
    if is_cuda and cudnn_benchmark:
        # cuDNN's heuristic picks a ~30 TFLOP/s fallback for one of the decoder's dilated convs (5.9 of
        # 27 ms of a 64 x 8-frame step on an H200, benchmarks/codec-steps.md); timed choice avoids it,
        # at the price of a longer start (every bucketed shape is timed in its graph's warm-up).
        torch.backends.cudnn.benchmark = True
    tokenizer = SpeechTokenizer.load(ckpt.path, device=stage.device, dtype=dtype, load_format=ckpt.load_format,
                                     with_encoder=False, seed=profile.seed)
    # on CUDA the pool is full-size from the start: growing it would drop the captured graphs
    streams = CodecStreams(tokenizer.decoder, max_streams=stage.max_num_seqs,
                           initial_slots=stage.max_num_seqs if is_cuda else min(8, stage.max_num_seqs))
    config = scheduler_config(stage, profile.chunking)
    if budget is not None:
        budget.check(0)  # weights and decoder state alone
    if is_cuda and warmup_frames > 0:
        num = streams.warmup(warmup_frames, max_frames=config.frames, check=budget.check if budget else None)
        log.info("codec_graphs_captured", stage=stage.name, num_graphs=num,
                 reserved_gib=round(torch.cuda.memory_reserved(stage.device) / 2**30, 2))
    return Worker(CodecScheduler(config), CodecRunner(streams, name=stage.name))


def scheduler_config(stage: Any, chunking: Any) -> CodecConfig:
    """The codec scheduler's settings from a stage and the profile's chunking (``tools/sim_codec.py`` too)."""
    frames = max(chunking.frames, chunking.initial_frames)
    return CodecConfig(stage=stage.name, max_num_seqs=stage.max_num_seqs,
                       max_frames_per_step=max(stage.max_num_tokens, frames), initial_frames=chunking.initial_frames,
                       frames=frames, urgent_s=chunking.urgent_s, join_fraction=chunking.join_fraction)
