"""The talker stage's runner: executes ``ArStepPlan``s on the slot state of ``TalkerState``.

One plan = admissions (slot resets) + prefill pieces (eager, batched, right-padded) + decode rows
(the captured frame step, or the same function eagerly) -> one codes row per seq. Everything for a plan
is enqueued in stream order, so a plan may be submitted while the previous one still runs: its
decodes read the next inputs and frame counters that the previous plan writes on the device.

CUDA: ``submit`` enqueues the work on the runner's stream, copies the codes into pinned memory
asynchronously, records an event and hands (event, finalize) to the ``CudaObserver``; the loop thread
never waits on the device. Host->device inputs go through pinned memory with ``non_blocking`` copies,
because a pageable copy would synchronize the stream (and so wait for the plan in flight).
CPU: ``step`` does the same work on the ``CpuRunner`` worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Protocol

import numpy as np
import torch

from omniloop.actors.doorway import Doorway
from omniloop.gpu.cuda_graphs import FrameGraphs, batch_buckets, kv_buckets
from omniloop.gpu.host_copy import to_device
from omniloop.gpu.kv_budget import module_bytes, size_talker_kv
from omniloop.gpu.observer import CudaObserver
from omniloop.gpu.prefill_graphs import PackedPrefillGraphs, PrefillGraphs, build_prefill_graphs
from omniloop.gpu.runner import CpuRunner, Runner
from omniloop.gpu.talker_state import TalkerState
from omniloop.models.qwen3_tts.prompt import Prompt, TtsInput, build_prompts
from omniloop.models.qwen3_tts.talker import Qwen3TtsModel
from omniloop.scheduler.plan import ArNew, ArSeq, ArStepPlan, ArStepResult


HIGH_PRIORITY = -100  # torch maps it to the device's highest stream priority


class TalkerPayload(Protocol):
    """What ``ArNew.payload`` carries for this stage (the stage module defines the concrete type)."""

    inputs: TtsInput
    prompt: Prompt | None


class TalkerSteps:
    """The device work of one plan, shared by the CPU and CUDA runners; returns codes on the device."""

    def __init__(self, model: Qwen3TtsModel, device: torch.device, max_num_seqs: int, max_len: int,
                 graphs: tuple[tuple[int, ...], tuple[int, ...]] | None, stream: torch.cuda.Stream | None,
                 prefill_graphs: bool = True, prefill_token_buckets: tuple[int, ...] | None = None) -> None:
        self.model, self.device = model, device
        if device.type == "cuda":
            model.fuse_projections()
        self.eos = model.cfg.talker.codec_eos_id
        # host ms of the last run's parts (admit, reset, prefill, frame, gather): what a step's submit time is
        # made of, for its trace span; a few clock reads a step
        self.phases_ms: dict[str, float] = {}
        self.state = TalkerState.allocate(model, max_num_seqs, max_len, max_trailing=max_len)
        self.graphs = FrameGraphs(self.state, stream, *graphs) if graphs is not None else None
        self.prefill_graphs: PrefillGraphs | PackedPrefillGraphs | None = None
        if graphs is not None and prefill_graphs:
            self.prefill_graphs = build_prefill_graphs(self.state, stream, max_num_seqs, prefill_token_buckets)
        # a voice clone's reference frames, sent with its first frame so the codec primes its state
        self.context: dict[int, np.ndarray] = {}
        # slot -> why its request could not be admitted; its later pieces (already planned: async overlap)
        # are skipped and reported, until a new request takes the slot
        self.failed: dict[int, str] = {}

    def _h2d(self, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """``array`` on the device (into ``out`` if given), never waiting for the step in flight."""
        return to_device(array, self.device, out)

    @torch.no_grad()
    def run(self, plan: ArStepPlan) -> tuple[torch.Tensor, dict[int, dict[str, np.ndarray]] | None,
                                             dict[int, str] | None]:
        """Codes int64 ``[len(plan.seqs), 16]`` on the device (rows of seqs that did not sample are 0), the
        arrays to attach to some rows' chunks (``ArStepResult.extras``), and the rows whose request could
        not be admitted (``ArStepResult.errors``): a request-scoped failure must not fail the whole step."""
        t0 = time.perf_counter()
        admitted = self._admit(plan.new) if plan.new else []
        t1 = time.perf_counter()
        if admitted:  # every admitted slot's state in one batched reset
            self.state.reset_many([a[0] for a in admitted], [a[1].embeds.to(self.model.dtype) for a in admitted],
                                  [a[1].trailing for a in admitted], [a[2].sampling or {} for a in admitted],
                                  [a[2].seed for a in admitted])
        t2 = time.perf_counter()
        errors = None
        if self.failed:
            errors = {i: self.failed[seq.slot] for i, seq in enumerate(plan.seqs) if seq.slot in self.failed} or None
        extras = None
        if self.context:
            extras = {i: {"context_codes": self.context.pop(seq.slot)} for i, seq in enumerate(plan.seqs)
                      if seq.is_sample and seq.slot in self.context} or None
        live = [i for i in range(len(plan.seqs)) if not errors or i not in errors]
        prefill = [i for i in live if not plan.seqs[i].is_decode]
        decode = [i for i in live if plan.seqs[i].is_decode]
        fresh: list[int] = []  # seqs whose prefill ends their prompt: first frame sampled in the frame step
        if prefill:
            fresh = [prefill[i] for i in self._prefill([plan.seqs[i] for i in prefill])]
        t3 = time.perf_counter()
        parts: list[torch.Tensor] = []
        index = np.zeros(len(plan.seqs), dtype=np.int64)  # row of the concatenated parts each seq reads
        offset = 0
        if decode or fresh:
            codes = self._decode([plan.seqs[i] for i in decode], [plan.seqs[i].slot for i in fresh])
            rows = decode + fresh
            index[rows] = offset + np.array([plan.seqs[i].slot for i in rows])
            parts.append(codes)
            offset += codes.shape[0]
        t4 = time.perf_counter()
        parts.append(torch.zeros(1, 16, dtype=torch.int64, device=self.device))
        unsampled = [i for i, seq in enumerate(plan.seqs) if not seq.is_sample or (errors and i in errors)]
        index[unsampled] = offset
        out = torch.cat(parts)[self._h2d(index)]
        t5 = time.perf_counter()
        self.phases_ms = {name: round((b - a) * 1e3, 3) for name, a, b in (
            ("admit", t0, t1), ("reset", t1, t2), ("prefill", t2, t3), ("frame", t3, t4), ("gather", t4, t5))}
        return out, extras, errors

    def _admit(self, news: list[ArNew]) -> list[tuple[int, Prompt, TtsInput]]:
        """(slot, prompt, inputs) of each new request that can start; the slots are reset by the caller. The
        prompts not carried by a payload are built in one batched call (``build_prompts``: a fixed number of
        ops, not ~25 per request), its ids and x-vectors crossing in pinned copies. A request that fails here
        (its voice encoder on its reference audio, its inputs, its trailing text) fails alone."""
        inputs: list[TtsInput | None] = []
        prompts: list[Prompt | Exception | None] = []
        for new in news:
            self.failed.pop(new.slot, None)
            payload: TalkerPayload = new.payload
            try:
                inputs.append(payload.inputs)  # may run the voice encoder (stage_talker's lazy payload)
                prompts.append(payload.prompt)
            except Exception as exc:  # noqa: BLE001 - request-scoped, reported as its error row
                inputs.append(None)
                prompts.append(exc)
        todo = [i for i, p in enumerate(prompts) if p is None]
        if todo:
            try:
                built = build_prompts(self.model, [inputs[i] for i in todo])
            except Exception as exc:  # noqa: BLE001 - the batched device work: as before, no whole-step failure
                built = [exc] * len(todo)
            for i, p in zip(todo, built):
                prompts[i] = p
        admitted: list[tuple[int, Prompt, TtsInput]] = []
        for new, inp, prompt in zip(news, inputs, prompts):
            self.context.pop(new.slot, None)
            if not isinstance(prompt, Exception):
                try:
                    self.state.check_trailing(prompt.trailing)  # here: request-scoped, not a failed step
                except ValueError as exc:
                    prompt = exc
            if isinstance(prompt, Exception):
                self.state.prompts.pop(new.slot, None)
                self.failed[new.slot] = f"{type(prompt).__name__}: {prompt}"
                continue
            if inp.ref_code is not None:
                self.context[new.slot] = inp.ref_code.cpu().numpy().astype(np.int64)
            admitted.append((new.slot, prompt, inp))
        return admitted

    def _prefill(self, seqs: list[ArSeq]) -> list[int]:
        """Batched, right-padded forwards over every piece: pieces from position 0 through a captured graph
        when one fits, the others (and all, without graphs) in one eager call. For pieces that end their
        prompt, the last hidden is parked in the slot's ``pending_hidden``: the frame step samples their first
        frame (``_decode``). Returns the indices into ``seqs`` of those pieces."""
        state, max_len = self.state, self.state.max_len
        pieces = []
        for seq in seqs:  # checks and packing only; the forwards below are batched calls
            prompt = state.prompts.get(seq.slot)
            end = seq.start + seq.num_tokens
            if prompt is None or end > prompt.shape[0]:
                have = 0 if prompt is None else prompt.shape[0]
                raise ValueError(f"request {seq.req_id!r}: prefill [{seq.start}, {end}) but slot {seq.slot} "
                                 f"holds a prompt of {have} positions")
            if end > max_len:
                raise ValueError(f"request {seq.req_id!r}: prompt positions up to {end} exceed max_len {max_len}")
            pieces.append(prompt[seq.start:end])
        whole = [i for i, seq in enumerate(seqs) if seq.start == 0] if self.prefill_graphs is not None else []
        bucket = self.prefill_graphs.bucket([seqs[i].num_tokens for i in whole]) if whole else None
        graphed = whole if bucket is not None else []
        eager = sorted(set(range(len(seqs))) - set(graphed))
        if graphed:
            slots = np.array([seqs[i].slot for i in graphed], dtype=np.int64)
            hidden, last = self.prefill_graphs.run(bucket, [pieces[i] for i in graphed], slots)
            self._park([seqs[i] for i in graphed], hidden, last)
        if eager:
            eager_seqs = [seqs[i] for i in eager]
            last = np.array([np.arange(len(eager)), [seq.num_tokens - 1 for seq in eager_seqs]], dtype=np.int64)
            self._park(eager_seqs, self._prefill_eager(eager_seqs, [pieces[i] for i in eager]), last)
        for seq in seqs:
            if seq.start + seq.num_tokens == state.prompts[seq.slot].shape[0]:
                del state.prompts[seq.slot]  # the stream still uses it; the caching allocator orders the reuse
        return [i for i, seq in enumerate(seqs) if seq.is_sample]

    def _prefill_eager(self, seqs: list[ArSeq], pieces: list[torch.Tensor]) -> torch.Tensor:
        state = self.state
        longest = max(seq.num_tokens for seq in seqs)
        pos = np.full((len(seqs), longest), state.max_len, dtype=np.int64)  # padding writes the scratch position
        for i, seq in enumerate(seqs):
            pos[i, : seq.num_tokens] = np.arange(seq.start, seq.start + seq.num_tokens)
        x = torch.nn.utils.rnn.pad_sequence(pieces, batch_first=True)
        slots = np.array([seq.slot for seq in seqs], dtype=np.int64)
        kv_len = max(seq.start + seq.num_tokens for seq in seqs)
        return self.model.talker.model(x, self._h2d(pos), state.cache.k, state.cache.v, self._h2d(slots), kv_len)

    def _park(self, seqs: list[ArSeq], hidden: torch.Tensor, last: np.ndarray) -> None:
        """``seqs[i]``'s piece ends at ``hidden[last[0, i], last[1, i]]``: park the last hidden of each piece
        that samples."""
        sampled = [i for i, seq in enumerate(seqs) if seq.is_sample]
        if not sampled:
            return
        rows_last_d = self._h2d(np.ascontiguousarray(last[:, sampled], dtype=np.int64))
        last = hidden[rows_last_d[0], rows_last_d[1]]
        slots = self._h2d(np.array([seqs[i].slot for i in sampled], dtype=np.int64))
        self.state.pending_hidden.index_copy_(0, slots, last.to(self.state.pending_hidden.dtype))

    def _decode(self, seqs: list[ArSeq], fresh_slots: list[int]) -> torch.Tensor:
        """The frame step for rows ``0..B-1`` (B >= the highest decoding or fresh slot + 1): decodes ``seqs``
        and samples the first frame of the just-prefilled ``fresh_slots``; returns codes ``[B, 16]``."""
        state = self.state
        slots = np.array([seq.slot for seq in seqs], dtype=np.int64)
        starts = np.array([seq.start for seq in seqs], dtype=np.int64)
        if len(starts) and starts.max() >= state.max_len:
            raise ValueError(f"decode position {int(starts.max())} reaches max_len {state.max_len}")
        num_rows = int(max(slots.max(initial=-1), max(fresh_slots, default=-1))) + 1
        kv_len = int(starts.max(initial=0)) + 1
        if self.graphs is not None:
            num_rows, kv_len = self.graphs.buckets_for(num_rows, kv_len)
        positions = np.full(num_rows, state.max_len, dtype=np.int64)  # fresh rows decode onto the scratch position
        positions[slots] = starts
        active = np.zeros(num_rows, dtype=np.bool_)
        active[slots] = True
        active[fresh_slots] = True
        fresh = np.zeros(num_rows, dtype=np.bool_)
        fresh[fresh_slots] = True
        self._h2d(positions, out=state.positions[:num_rows])
        self._h2d(active, out=state.active[:num_rows])
        self._h2d(fresh, out=state.fresh[:num_rows])
        if self.graphs is not None:
            return self.graphs.replay(num_rows, kv_len)
        return state.decode_frame(num_rows, kv_len)


def _result(codes: np.ndarray, eos: int, extras: dict[int, dict[str, np.ndarray]] | None,
            errors: dict[int, str] | None) -> ArStepResult:
    return ArStepResult(codes=codes, is_stop=codes[:, 0] == eos, extras=extras, errors=errors)


def _finalize(host: torch.Tensor, eos: int, extras: dict[int, dict[str, np.ndarray]] | None,
              errors: dict[int, str] | None) -> ArStepResult:
    """On the observer thread, after the step's event: an owned copy, so the pinned block can be recycled."""
    return _result(host.numpy().copy(), eos, extras, errors)


class CpuTalkerRunner(CpuRunner):
    def __init__(self, model: Qwen3TtsModel, *, max_num_seqs: int, max_len: int,
                 doorway: Doorway | None = None) -> None:
        super().__init__("talker", doorway)
        self.steps: TalkerSteps | None = TalkerSteps(model, torch.device("cpu"), max_num_seqs, max_len, None, None)

    def step(self, plan: ArStepPlan) -> ArStepResult:
        if self.steps is None:
            raise RuntimeError("CpuTalkerRunner is closed")
        codes, extras, errors = self.steps.run(plan)
        return _result(codes.numpy(), self.steps.eos, extras, errors)

    def close(self) -> None:
        super().close()
        if self.steps is not None:
            self.steps.model.cache = None
            self.steps = None


class CudaTalkerRunner(Runner):
    def __init__(self, model: Qwen3TtsModel, *, device: torch.device, max_num_seqs: int, max_len: int,
                 use_cuda_graphs: bool, doorway: Doorway | None = None,
                 graph_buckets: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                 prefill_graphs: bool = True, prefill_token_buckets: tuple[int, ...] | None = None) -> None:
        super().__init__(doorway)
        self.device = device
        # the highest priority the device has: where stages share a process (placement thread), the GPU's
        # block scheduler dispatches the talker's short, latency-bound kernels ahead of the codec's long ones
        self.stream = torch.cuda.Stream(device, priority=HIGH_PRIORITY)
        buckets = None
        if use_cuda_graphs:
            buckets = graph_buckets or (batch_buckets(max_num_seqs), kv_buckets(max_len))
        with torch.cuda.device(device), torch.cuda.stream(self.stream):
            self.steps: TalkerSteps | None = TalkerSteps(model, device, max_num_seqs, max_len, buckets, self.stream,
                                                         prefill_graphs=prefill_graphs,
                                                         prefill_token_buckets=prefill_token_buckets)
        self.stream.synchronize()  # start-up only: allocation and capture are done before the first step
        self._observer = self.add_observer(CudaObserver(self.doorway, name="talker-cuda-observer"))

    def submit(self, plan: ArStepPlan) -> asyncio.Future:
        if self.steps is None:
            raise RuntimeError("CudaTalkerRunner is closed")
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                codes, extras, errors = self.steps.run(plan)
                started = time.perf_counter()
                host = torch.empty(codes.shape, dtype=codes.dtype, pin_memory=True)
                host.copy_(codes, non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # the observer sleeps on it instead of spinning
                event.record(self.stream)
                self.steps.phases_ms["out"] = round((time.perf_counter() - started) * 1e3, 3)
        except Exception as exc:  # noqa: BLE001 - a bad plan fails its own future, like a failed step
            future = self.doorway.loop.create_future()
            future.set_exception(exc)
            return future
        return self._observer.submit(event, functools.partial(_finalize, host, self.steps.eos, extras, errors))

    @property
    def phases_ms(self) -> dict[str, float] | None:
        """Host ms of the last submitted plan's parts (``TalkerSteps.phases_ms`` + ``out``: the codes' copy out)."""
        return dict(self.steps.phases_ms) if self.steps is not None else None

    def close(self) -> None:
        super().close()
        if self.steps is not None:
            self.steps.model.cache = None
            self.steps = None
            torch.cuda.empty_cache()


def TalkerRunner(model: Qwen3TtsModel, *, device: torch.device | str, max_num_seqs: int, max_len: int,  # noqa: N802
                 use_cuda_graphs: bool, doorway: Doorway | None = None, gpu_memory_fraction: float | None = None,
                 graph_buckets: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                 stage: str = "talker", prefill_graphs: bool = True,
                 prefill_token_buckets: tuple[int, ...] | None = None) -> CpuTalkerRunner | CudaTalkerRunner:
    """The talker runner for ``device``: the CUDA runner (graphs optional) or the CPU one.

    ``prefill_graphs`` (CUDA, with ``use_cuda_graphs``): also capture the batched prefill: packed prompts, or one
    graph per (rows, tokens) bucket where ``prefill_token_buckets`` names the tokens (``build_prefill_graphs``).
    ``gpu_memory_fraction`` (CUDA): check that ``max_num_seqs`` x ``max_len`` fits the stage's share of
    device memory before allocating, with an error naming the numbers (see ``kv_budget``)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuTalkerRunner(model, max_num_seqs=max_num_seqs, max_len=max_len, doorway=doorway)
    if gpu_memory_fraction is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        size_talker_kv(stage, model.cfg, model.dtype, max_num_seqs=max_num_seqs, total_bytes=total,
                       gpu_memory_fraction=gpu_memory_fraction, weight_bytes=module_bytes(model), max_len=max_len)
    return CudaTalkerRunner(model, device=device, max_num_seqs=max_num_seqs, max_len=max_len,
                            use_cuda_graphs=use_cuda_graphs, doorway=doorway, graph_buckets=graph_buckets,
                            prefill_graphs=prefill_graphs, prefill_token_buckets=prefill_token_buckets)
