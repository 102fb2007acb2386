"""The talker runner on CPU, driven by hand-made plans: its codes equal ``generate()``'s for the same
inputs (greedy and seeded), with chunked prefill over two plans, two plans in flight, mixed
prefill + decode plans, and a slot reused right after its request ended; plus the KV budget."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import cache

import pytest
import torch

from omniloop.gpu.kv_budget import GiB, size_talker_kv
from omniloop.gpu.talker_runner import TalkerRunner
from omniloop.models.qwen3_tts.checkpoint import build_model
from omniloop.models.qwen3_tts.config import load_tts_config
from omniloop.models.qwen3_tts.generate import generate
from omniloop.models.qwen3_tts.prompt import Prompt, TtsInput, build_prompt
from omniloop.models.qwen3_tts.talker import Qwen3TtsModel
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint
from omniloop.models.qwen3_tts.tokenizer import TextTokenizer
from omniloop.scheduler.plan import ArNew, ArSeq, ArStepPlan

SEEDED = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.05,
              sub_do_sample=True, sub_temperature=0.9, sub_top_k=40, sub_top_p=0.95)


@dataclass
class Payload:
    inputs: TtsInput
    prompt: Prompt | None = None


@dataclass
class Job:
    """One request as the test's little scheduler sees it."""

    req_id: str
    slot: int
    inp: TtsInput
    chunks: list[int]  # prefill piece sizes, summing to the prompt length
    num_frames: int
    after: str | None = None  # admitted only once this job has scheduled its last piece (slot reuse)
    num_computed: int = 0
    num_sampled: int = 0
    is_admitted: bool = False
    codes: list[list[int]] = field(default_factory=list)

    @property
    def is_done(self) -> bool:
        return self.num_sampled == self.num_frames


@cache
def _model() -> tuple[Qwen3TtsModel, TextTokenizer]:
    torch.set_num_threads(1)
    ckpt = ensure_tiny_checkpoint("custom_voice")
    model, _ = build_model(cfg=load_tts_config(ckpt), load_format="dummy", seed=1)
    return model, TextTokenizer.from_dir(ckpt)


def _input(text: str, frames: int, sampling: dict | None = None, seed: int = 0) -> TtsInput:
    _, tok = _model()
    return TtsInput(task="custom_voice", input_ids=tok.assistant_ids(text), speaker="ryan",
                    max_new_tokens=frames + 1, sampling=sampling, seed=seed)


def _plans(jobs: list[Job]):
    """Yield plans tick by tick; each live job contributes its next piece (async: no results needed)."""
    step_id = 0
    while not all(job.is_done for job in jobs):
        plan = ArStepPlan(step_id=step_id, seqs=[])
        was_done = {job.req_id for job in jobs if job.is_done}  # a slot is free from the next plan on
        for job in jobs:
            if job.is_done or (job.after is not None and job.after not in was_done):
                continue
            if not job.is_admitted:
                plan.new.append(ArNew(job.req_id, job.slot, Payload(job.inp)))
                job.is_admitted = True
            prompt_len = sum(job.chunks)
            if job.num_computed < prompt_len:
                done = job.num_computed
                n = next(c for c, end in zip(job.chunks, _cumsum(job.chunks)) if end > done)
                is_sample = done + n == prompt_len
                plan.seqs.append(ArSeq(job.req_id, job.slot, done, n, is_sample, False))
            else:
                n, is_sample = 1, True
                plan.seqs.append(ArSeq(job.req_id, job.slot, job.num_computed, 1, True, True))
            job.num_computed += n
            job.num_sampled += is_sample
        step_id += 1
        yield plan


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def _run(jobs: list[Job], max_num_seqs: int, max_len: int, in_flight: int = 2, model: Qwen3TtsModel | None = None,
         **runner_kw) -> dict[str, torch.Tensor]:
    """Drive a fresh runner (CPU unless ``runner_kw`` says otherwise) with ``jobs``; codes per request."""
    model = model or _model()[0]
    runner_kw = {"device": "cpu", "use_cuda_graphs": False, **runner_kw}
    for job in jobs:  # the driver's own bookkeeping; the runner builds its prompts itself
        job.num_computed = job.num_sampled = 0

    async def drive() -> None:
        runner = TalkerRunner(model, max_num_seqs=max_num_seqs, max_len=max_len, **runner_kw)
        rows = {job.req_id: job for job in jobs}
        pending: list[tuple[ArStepPlan, asyncio.Future]] = []
        try:
            for plan in _plans(jobs):
                pending.append((plan, runner.submit(plan)))
                if len(pending) == in_flight:
                    done_plan, future = pending.pop(0)
                    _record(rows, done_plan, await future)
            for done_plan, future in pending:
                _record(rows, done_plan, await future)
        finally:
            runner.close()

    for job in jobs:
        job.codes.clear()
    asyncio.run(drive())
    return {job.req_id: torch.tensor(job.codes, dtype=torch.int64).reshape(-1, 16) for job in jobs}


def _record(rows: dict[str, Job], plan: ArStepPlan, result) -> None:
    assert result.codes.shape == (len(plan.seqs), 16) and result.codes.dtype.name == "int64"
    for i, seq in enumerate(plan.seqs):
        if seq.is_sample:
            assert not result.is_stop[i]  # dummy weights never reach EOS in these few frames (checked below)
            rows[seq.req_id].codes.append(result.codes[i].tolist())


def _expected(inp: TtsInput, model: Qwen3TtsModel | None = None) -> torch.Tensor:
    (out,) = generate(model or _model()[0], [inp])
    assert out.reason == "length"  # so every sampled frame is a real frame
    return out.codes.cpu()


def _prompt_len(inp: TtsInput) -> int:
    return build_prompt(_model()[0], inp).embeds.shape[0]


def test_codes_equal_generate_with_chunked_prefill_overlap_and_slot_reuse() -> None:
    greedy = _input("Hello there, runner.", frames=6)
    seeded = _input("A seeded request.", frames=8, sampling=SEEDED, seed=1234)
    reuse = _input("Slot zero again.", frames=5, sampling=SEEDED, seed=7)
    n_greedy, n_seeded, n_reuse = _prompt_len(greedy), _prompt_len(seeded), _prompt_len(reuse)
    jobs = [
        Job("greedy", 0, greedy, [n_greedy // 2, n_greedy - n_greedy // 2], 6),  # chunked over 2 plans
        Job("seeded", 2, seeded, [n_seeded], 8),  # slot 1 left idle: decode rows 0..2 mask it
        Job("reuse", 0, reuse, [5, n_reuse - 5], 5, after="greedy"),  # reset while slot 0's last step runs
    ]
    got = _run(jobs, max_num_seqs=4, max_len=96)
    assert torch.equal(got["greedy"], _expected(greedy))
    assert torch.equal(got["seeded"], _expected(seeded))
    assert torch.equal(got["reuse"], _expected(reuse))


def test_one_plan_in_flight_gives_the_same_codes_as_two() -> None:
    inp = _input("Overlap must not change anything.", frames=4, sampling=SEEDED, seed=99)
    n = _prompt_len(inp)
    one = _run([Job("r", 1, inp, [n], 4)], max_num_seqs=2, max_len=64, in_flight=1)["r"]
    two = _run([Job("r", 1, inp, [n], 4)], max_num_seqs=2, max_len=64, in_flight=2)["r"]
    assert torch.equal(one, two) and torch.equal(one, _expected(inp))


def test_bad_plan_fails_its_future_with_a_clear_error() -> None:
    model, _ = _model()
    inp = _input("short", frames=2)

    async def drive() -> str:
        runner = TalkerRunner(model, device="cpu", max_num_seqs=1, max_len=64, use_cuda_graphs=False)
        try:
            plan = ArStepPlan(0, [ArSeq("r", 0, 0, 500, True, False)], [ArNew("r", 0, Payload(inp))])
            with pytest.raises(ValueError) as err:
                await runner.submit(plan)
            return str(err.value)
        finally:
            runner.close()

    message = asyncio.run(drive())
    assert "'r'" in message and "500" in message


def test_kv_budget_sizes_max_len_and_names_the_numbers_when_it_does_not_fit() -> None:
    cfg = _model()[0].cfg
    sizing = size_talker_kv("talker", cfg, torch.bfloat16, max_num_seqs=8, total_bytes=4 * GiB,
                            gpu_memory_fraction=0.5, weight_bytes=GiB // 2, reserve_bytes=GiB // 4)
    assert sizing.num_slots == 8 and sizing.max_len >= 1
    assert sizing.cache_bytes <= sizing.budget_bytes
    real = load_tts_config(ensure_tiny_checkpoint("base", size="1.7b"))  # the released 1.7B shapes
    with pytest.raises(ValueError) as err:
        size_talker_kv("talker", real, torch.bfloat16, max_num_seqs=64, total_bytes=80 * GiB,
                       gpu_memory_fraction=0.3, weight_bytes=4 * GiB, max_len=8192)
    text = str(err.value)
    assert "'talker'" in text and "64 slots x 8192" in text and "0.3" in text and "118784 B" in text
