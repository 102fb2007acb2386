"""Deterministic fake stages for testing the runtime without weights (and without torch).

Outputs are pure functions of the request text, so tests compute the expected stream on their own:

- ``fake.thinker``: one word of the request text per step; the word goes to the frontend as a text
  delta, a hidden-state row (float32 [1, HIDDEN]) goes downstream.
- ``fake.ar`` (talker-like): one frame of 16 int64 codes per request per step,
  ``codes[f, j] = (crc32(text) % 2048 + 16 * f + j) % 2048``; ``len(text) * frames_per_char`` frames
  (reason "stop"), cut to ``request.max_frames`` (reason "length"). Behind an upstream stage, each
  upstream chunk unlocks ``frames_per_chunk`` frames and the final one unlocks the rest.
- ``fake.codec``: ``pcm[f * 1920 + k] = ((codes[f, k % 16] * 7 + k) % 1000) / 1000 - 0.5`` (float32);
  emits a pcm chunk per step and, at the end, the final chunk and the request's Finish.

Options (``stage.options``): ``step_ms`` (per-step sleep, simulating device time), ``raise_marker``
(a step containing a request whose text has this substring raises), ``frames_per_char``,
``frames_per_chunk``.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import numpy as np

from omniloop.errors import RequestError
from omniloop.gpu.runner import CpuRunner
from omniloop.models.registry import ModelInfo, Worker, register, register_info, register_validator
from omniloop.scheduler.fifo import FifoPlan, FifoScheduler, Seq
from omniloop.scheduler.interface import Emit
from omniloop.transport.messages import ChatRequest, Chunk, Finish, Reason, SpeechRequest

NUM_CODEBOOKS = 16
CODEBOOK_SIZE = 2048
SAMPLES_PER_FRAME = 1920
HIDDEN = 8
_OPTIONS = {"step_ms", "raise_marker", "frames_per_char", "frames_per_chunk", "close_ms"}


def request_text(request: SpeechRequest | ChatRequest) -> str:
    if isinstance(request, SpeechRequest):
        return request.text
    for message in reversed(request.messages):
        content = message.get("content")
        if isinstance(content, str):
            return content
    return ""


def frame_codes(text: str, first: int, num: int) -> np.ndarray:
    base = zlib.crc32(text.encode("utf-8")) % CODEBOOK_SIZE
    frames = np.arange(first, first + num, dtype=np.int64)[:, None]
    return (base + NUM_CODEBOOKS * frames + np.arange(NUM_CODEBOOKS, dtype=np.int64)) % CODEBOOK_SIZE


def decode_codes(codes: np.ndarray) -> np.ndarray:
    k = np.arange(SAMPLES_PER_FRAME, dtype=np.int64)
    values = (codes[:, k % NUM_CODEBOOKS] * 7 + k) % 1000
    return (values / 1000.0 - 0.5).astype(np.float32).reshape(-1)


def hidden_row(text: str, index: int) -> np.ndarray:
    base = zlib.crc32(text.encode("utf-8")) % 1000
    return ((base + index * HIDDEN + np.arange(HIDDEN)) % 100 / 100.0).astype(np.float32)[None, :]


class FakeRunner(CpuRunner):
    """Runs ``compute(payload)`` per request after ``step_ms`` of simulated device time."""

    def __init__(self, stage: Any, compute: Any) -> None:
        super().__init__(stage.name)
        self.stage = stage.name
        self._compute = compute
        self._step_s = float(stage.options.get("step_ms", 1.0)) / 1000.0
        self._marker = stage.options.get("raise_marker")
        self._close_s = float(stage.options.get("close_ms", 0.0)) / 1000.0  # a slow release (GPU stages)

    def close(self) -> None:
        time.sleep(self._close_s)
        super().close()

    def step(self, plan: FifoPlan) -> list[Any]:
        time.sleep(self._step_s)
        if self._marker:
            for item in plan.items:
                if self._marker in item.payload[0]:
                    raise RuntimeError(f"fake failure in stage {self.stage!r} for request {item.req_id!r}")
        return [self._compute(item.payload) for item in plan.items]


class _FakeScheduler(FifoScheduler):
    def __init__(self, stage: Any, profile: Any) -> None:
        unknown = set(stage.options) - _OPTIONS
        if unknown:
            raise ValueError(f"stage {stage.name!r} ({stage.model}): unknown options {sorted(unknown)}")
        super().__init__(
            stage.name,
            max_num_seqs=stage.max_num_seqs,
            has_upstream=profile.first_stage.name != stage.name,
            has_downstream=profile.next_of(stage.name) is not None,
        )
        self.options = stage.options


class ThinkerScheduler(_FakeScheduler):
    def on_add(self, seq: Seq) -> list[Emit]:
        seq.state = request_text(seq.submit.request).split() or [""]
        return []

    def is_runnable(self, seq: Seq) -> bool:
        return seq.num_steps < len(seq.state)

    def prepare(self, seq: Seq) -> tuple[str, int]:
        return request_text(seq.submit.request), seq.num_steps

    def on_output(self, seq: Seq, hidden: np.ndarray) -> list[Emit]:
        index = seq.num_steps - 1
        is_last = seq.num_steps == len(seq.state)
        delta = seq.state[index] + ("" if is_last else " ")
        emits = [
            Emit("frontend", Chunk(seq.req_id, index, text=delta, stage=self.stage)),
            Emit(
                "next",
                Chunk(seq.req_id, self.next_seq(seq), final=is_last, reason=Reason.STOP.value if is_last else None,
                      stage=self.stage),
                {"hidden": hidden},
            ),
        ]
        if is_last:
            self.finish(seq)
        return emits


class ArScheduler(_FakeScheduler):
    def on_add(self, seq: Seq) -> list[Emit]:
        request = seq.submit.request
        total = max(1, len(request_text(request)) * int(self.options.get("frames_per_char", 1)))
        max_frames = getattr(request, "max_frames", None)
        reason = Reason.STOP.value
        if max_frames is not None and max_frames < total:
            total, reason = max_frames, Reason.LENGTH.value
        seq.state = (total, reason)
        return []

    def _allowed(self, seq: Seq) -> int:
        total = seq.state[0]
        if seq.is_upstream_done:
            return total
        return min(total, seq.num_upstream_chunks * int(self.options.get("frames_per_chunk", 2)))

    def is_runnable(self, seq: Seq) -> bool:
        return seq.num_steps < self._allowed(seq)

    def prepare(self, seq: Seq) -> tuple[str, int]:
        seq.inputs.clear()  # the fake only counts upstream chunks; a real talker consumes them
        return request_text(seq.submit.request), seq.num_steps

    def on_output(self, seq: Seq, codes: np.ndarray) -> list[Emit]:
        total, reason = seq.state
        is_last = seq.num_steps == total
        chunk = Chunk(seq.req_id, self.next_seq(seq), final=is_last, reason=reason if is_last else None,
                      stage=self.stage)
        if is_last:
            self.finish(seq)
        return [Emit("next", chunk, {"codes": codes})]


class CodecScheduler(_FakeScheduler):
    def on_add(self, seq: Seq) -> list[Emit]:
        seq.state = [0, False]  # frames decoded, final chunk prepared
        return []

    def is_runnable(self, seq: Seq) -> bool:
        return bool(seq.inputs) or (seq.is_upstream_done and not seq.state[1])

    def prepare(self, seq: Seq) -> tuple[str, np.ndarray]:
        parts = [arrays["codes"] for _, arrays in seq.inputs if "codes" in arrays]
        seq.inputs.clear()
        codes = np.concatenate(parts) if parts else np.zeros((0, NUM_CODEBOOKS), np.int64)
        seq.state[1] = seq.is_upstream_done
        return request_text(seq.submit.request), codes

    def on_output(self, seq: Seq, pcm: np.ndarray) -> list[Emit]:
        seq.state[0] += pcm.shape[0] // SAMPLES_PER_FRAME
        is_last = seq.state[1]
        reason = seq.upstream_reason or Reason.STOP.value
        emits = [
            Emit("next", Chunk(seq.req_id, self.next_seq(seq), final=is_last, reason=reason if is_last else None,
                               stage=self.stage), {"pcm": pcm})
        ]
        if is_last:
            self.finish(seq)
            emits.append(Emit("next", Finish(seq.req_id, reason, stage=self.stage, num_frames=seq.state[0])))
        return emits


def _worker(scheduler_cls: type[_FakeScheduler], compute: Any, stage: Any, profile: Any) -> Worker:
    scheduler = scheduler_cls(stage, profile)
    return Worker(scheduler, FakeRunner(stage, compute))


@register("fake.thinker")
def build_thinker(stage: Any, profile: Any) -> Worker:
    return _worker(ThinkerScheduler, lambda p: hidden_row(p[0], p[1]), stage, profile)


@register("fake.ar")
def build_ar(stage: Any, profile: Any) -> Worker:
    return _worker(ArScheduler, lambda p: frame_codes(p[0], p[1], 1), stage, profile)


@register("fake.codec")
def build_codec(stage: Any, profile: Any) -> Worker:
    return _worker(CodecScheduler, lambda p: decode_codes(p[1]), stage, profile)


@register_validator("fake")
def validate(request: Any, profile: Any) -> None:
    if not isinstance(request, (SpeechRequest, ChatRequest)):
        raise RequestError(400, f"expected a SpeechRequest or ChatRequest, got {type(request).__name__}")
    text = request_text(request)
    if not text.strip():
        raise RequestError(400, "text must not be empty")
    if len(text) > profile.max_text_chars:
        raise RequestError(400, f"text has {len(text)} characters; this server takes at most {profile.max_text_chars}")
    max_frames = getattr(request, "max_frames", None)
    if max_frames is not None and max_frames < 1:
        raise RequestError(400, f"max_frames must be >= 1, got {max_frames}")


@register_info("fake")
def info(profile: Any) -> ModelInfo:
    return ModelInfo(name=profile.name, task_types=("custom_voice",), speakers=("fake",), languages=("auto",),
                     supports_chat=profile.first_stage.model == "fake.thinker")
