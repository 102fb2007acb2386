"""``build_prompts``: the talker prompts of every request admitted in one step, built together. Each prompt
equals the per-request construction it replaced, bit for bit, for every task and text mode; a bad request
gets its own error and the others still get their prompts; and the torch op count does not grow with the
number of requests (the old construction launched ~25 small kernels per request)."""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omniloop.gpu.talker_runner import TalkerSteps
from omniloop.models.qwen3_tts.checkpoint import build_model
from omniloop.models.qwen3_tts.config import load_tts_config
from omniloop.models.qwen3_tts.prompt import Prompt, TtsInput, build_prompt, build_prompts, language_id, prompt_length
from omniloop.models.qwen3_tts.talker import Qwen3TtsModel
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint
from omniloop.models.qwen3_tts.tokenizer import TextTokenizer
from omniloop.scheduler.plan import ArNew, ArStepPlan


# ---------------------------------------------------------------------------------------------------------
# REFERENCE ONLY: the per-request ``build_prompt`` as it was before ``build_prompts`` (omniloop e889ba3),
# kept verbatim as the oracle of these tests (with ``Qwen3TtsModel.codec_rows``, since removed, inlined as
# ``_codec_rows``). Not used by the engine.
def _codec_rows(model: Qwen3TtsModel, ids: list[int]) -> torch.Tensor:
    weight = model.talker.codec_embedding.weight
    return torch.stack([weight[i] for i in ids])


def _ref_speaker_embed(model: Qwen3TtsModel, req: TtsInput) -> torch.Tensor | None:
    if req.task == "base":
        if req.x_vector is None:
            raise ValueError("task 'base' needs the reference x-vector")
        return req.x_vector.to(model.device, model.dtype).reshape(1, -1)
    if req.speaker:
        spk = model.cfg.talker.spk_id.get(req.speaker.lower())
        if spk is None:
            raise ValueError(f"unknown speaker {req.speaker!r}; valid: {list(model.cfg.speakers)}")
        return _codec_rows(model, [spk])
    return None


def _ref_icl_body(model: Qwen3TtsModel, req: TtsInput, text_ids: torch.Tensor, eos: torch.Tensor,
                  pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tc = model.cfg.talker
    if req.ref_ids is None:
        raise ValueError("in-context cloning needs ref_ids (the reference transcript)")
    text = torch.cat((model.text_embed(torch.cat((req.ref_ids[3:-2], text_ids))), eos[None]), 0)
    ref_code = req.ref_code.to(model.device)
    codec = torch.cat((_codec_rows(model, [tc.codec_bos_id]), model.frame_embed(ref_code)), 0)
    if not req.streaming_text:
        text_part = text + _codec_rows(model, [tc.codec_pad_id])
        return torch.cat((text_part, codec + pad), 0), pad[None]
    if text.shape[0] > codec.shape[0]:
        return text[: codec.shape[0]] + codec, text[codec.shape[0]:]
    padded = torch.cat((text, pad.expand(codec.shape[0] - text.shape[0], -1)), 0)
    return padded + codec, pad[None]


@torch.no_grad()
def reference_build_prompt(model: Qwen3TtsModel, req: TtsInput) -> Prompt:
    tc = model.cfg.talker
    bos, eos, pad = model.special_embeds()
    ids = req.input_ids.to(torch.int64).reshape(-1)
    if ids.shape[0] < 9:
        raise ValueError(f"input_ids has {ids.shape[0]} tokens; the assistant template alone has 8")
    lang_id = language_id(model.cfg, req)
    prefix = ([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id] if lang_id is None
              else [tc.codec_think_id, tc.codec_think_bos_id, lang_id, tc.codec_think_eos_id])
    codec = [_codec_rows(model, prefix)]
    speaker = _ref_speaker_embed(model, req)
    if speaker is not None:
        codec.append(speaker)
    codec.append(_codec_rows(model, [tc.codec_pad_id, tc.codec_bos_id]))
    codec_t = torch.cat(codec, 0)
    n_codec = codec_t.shape[0]
    head = torch.cat((pad.expand(n_codec - 2, -1), bos[None]), 0) + codec_t[:-1]
    parts = []
    if req.instruct_ids is not None and req.instruct_ids.numel() > 0:
        parts.append(model.text_embed(req.instruct_ids.reshape(-1)))
    parts += [model.text_embed(ids[:3]), head]
    text_ids = ids[3:-5]
    if req.is_icl:
        body, trailing = _ref_icl_body(model, req, text_ids, eos, pad)
        parts.append(body)
    elif req.streaming_text:
        parts.append(model.text_embed(ids[3:4]) + codec_t[-1:])
        trailing = torch.cat((model.text_embed(ids[4:-5]), eos[None]), 0)
    else:
        text = torch.cat((model.text_embed(text_ids), eos[None]), 0)
        parts.append(text + _codec_rows(model, [tc.codec_pad_id]))
        parts.append(pad[None] + codec_t[-1:])
        trailing = pad[None]
    return Prompt(embeds=torch.cat(parts, 0), trailing=trailing)
# END OF REFERENCE
# ---------------------------------------------------------------------------------------------------------


@cache
def _model() -> tuple[Qwen3TtsModel, TextTokenizer]:
    # custom_voice: its config has speakers, one of them a dialect speaker (eric: sichuan_dialect); prompts do
    # not depend on the checkpoint's variant, so base and voice_design requests run on it as well
    ckpt = ensure_tiny_checkpoint("custom_voice")
    model, _ = build_model(cfg=load_tts_config(ckpt), load_format="dummy", seed=3)
    assert model.cfg.talker.spk_is_dialect.get("eric")  # the dialect case below needs it
    return model, TextTokenizer.from_dir(ckpt)


def _variants() -> dict[str, TtsInput]:
    model, tok = _model()
    h = model.cfg.talker.decoder.hidden_size
    gen = torch.Generator().manual_seed(5)
    x_vector = torch.randn(h, generator=gen)
    codes = lambda n: torch.randint(0, 2048, (n, 16), generator=gen)  # noqa: E731
    text = tok.assistant_ids("Hello there, this is a batched prompt.")
    short = tok.assistant_ids("Hi")
    ref = tok.ref_ids("A reference transcript.")
    cv = dict(task="custom_voice", input_ids=text)
    return {
        "cv_speaker": TtsInput(**cv, speaker="ryan", language="english"),
        "cv_speaker_auto_instruct": TtsInput(**cv, speaker="Ryan", instruct_ids=tok.instruct_ids("Speak slowly.")),
        "cv_dialect_auto": TtsInput(**cv, speaker="eric"),
        "cv_dialect_chinese_streaming": TtsInput(**cv, speaker="eric", language="Chinese", non_streaming=False),
        "cv_streaming_short": TtsInput(task="custom_voice", input_ids=short, speaker="vivian", non_streaming=False),
        "vd_instruct": TtsInput(task="voice_design", input_ids=text, language="english",
                                instruct_ids=tok.instruct_ids("A calm, low voice.")),
        "vd_no_instruct_streaming": TtsInput(task="voice_design", input_ids=short, non_streaming=False),
        "base_xvec": TtsInput(task="base", input_ids=text, x_vector=x_vector),
        "base_xvec_nonstreaming_french": TtsInput(task="base", input_ids=text, x_vector=x_vector.double(),
                                                  language="french", non_streaming=True),
        "base_icl_streaming_text_longer": TtsInput(task="base", input_ids=text, x_vector=x_vector, ref_ids=ref,
                                                   ref_code=codes(3)),
        "base_icl_streaming_codes_longer": TtsInput(task="base", input_ids=short, x_vector=x_vector[None],
                                                    ref_ids=ref, ref_code=codes(40), language="german"),
        "base_icl_nonstreaming": TtsInput(task="base", input_ids=text, x_vector=x_vector, ref_ids=ref,
                                          ref_code=codes(7).to(torch.int32), non_streaming=True),
    }


def _bad() -> dict[str, TtsInput]:
    model, tok = _model()
    text = tok.assistant_ids("Fine text.")
    return {
        "unknown_speaker": TtsInput(task="custom_voice", input_ids=text, speaker="nobody"),
        "unknown_language": TtsInput(task="custom_voice", input_ids=text, speaker="ryan", language="klingon"),
        "too_short": TtsInput(task="voice_design", input_ids=text[:8]),
        "no_xvector": TtsInput(task="base", input_ids=text),
        "icl_without_ref_ids": TtsInput(task="base", input_ids=text, x_vector=torch.zeros(64),
                                        ref_code=torch.zeros(4, 16, dtype=torch.int64)),
    }


# Rows the per-request construction (and qwen-tts) projected through ``text_projection`` alone, as a matmul of
# one row: on CPU in float32 that takes another BLAS path than the batched matmul of many rows, and differs by
# a few ulps (max abs 2.7e-7 seen here). Every other row is bit-equal.
LONE_ROW_ATOL = 1e-6


def _lone_rows(req: TtsInput) -> tuple[set[int], set[int]]:
    """(prompt rows, trailing rows) that the reference projected one at a time: the first text token of a
    streaming non-ICL prompt, and its trailing text when that is a single token."""
    if req.is_icl or not req.streaming_text:
        return set(), set()
    num_prompt = prompt_length(_model()[0].cfg, req)
    return {num_prompt - 1}, ({0} if req.input_ids.numel() - 9 == 1 else set())


def _assert_same(got: Prompt, want: Prompt, req: TtsInput, name: str) -> None:
    assert got.embeds.shape == want.embeds.shape and got.trailing.shape == want.trailing.shape, name
    assert got.embeds.dtype == want.embeds.dtype, name
    for part, lone in zip(("embeds", "trailing"), _lone_rows(req)):
        a, b = getattr(got, part), getattr(want, part)
        differ = {int(i) for i in (a != b).any(1).nonzero().flatten()}
        assert differ <= lone, (name, part, sorted(differ - lone))
        torch.testing.assert_close(a, b, rtol=0, atol=LONE_ROW_ATOL)


@pytest.mark.parametrize("name", sorted(_variants()))
def test_each_variant_alone_equals_the_per_request_construction(name: str) -> None:
    model, _ = _model()
    req = _variants()[name]
    got = build_prompt(model, req)
    _assert_same(got, reference_build_prompt(model, req), req, name)
    num_ref = 0 if req.ref_code is None else req.ref_code.shape[0]
    assert got.embeds.shape[0] == prompt_length(model.cfg, dataclasses.replace(req, ref_code=None), num_ref)
    assert got.embeds.shape[0] == prompt_length(model.cfg, req)


def test_mixed_batch_with_bad_requests_equals_the_per_request_construction() -> None:
    model, _ = _model()
    good, bad = _variants(), _bad()
    # bad requests first, in the middle and last; the good ones twice, so text ids repeat across requests
    names = [*list(bad)[:2], *good, *list(bad)[2:4], *reversed(list(good)), list(bad)[4]]
    reqs = [good.get(n) or bad[n] for n in names]
    out = build_prompts(model, reqs)
    assert len(out) == len(reqs)
    for name, req, got in zip(names, reqs, out):
        if name in bad:
            with pytest.raises(ValueError) as want:
                reference_build_prompt(model, req)
            assert isinstance(got, ValueError) and str(got) == str(want.value), name
            with pytest.raises(ValueError, match=str(want.value).split(";")[0][:20]):
                build_prompt(model, req)
        else:
            assert isinstance(got, Prompt), (name, got)
            _assert_same(got, reference_build_prompt(model, req), req, name)


def test_out_of_range_inputs_fail_alone() -> None:
    """Inside one batched gather an out-of-range id would fail every request (on CUDA: the context)."""
    model, _ = _model()
    good = _variants()["base_icl_nonstreaming"]
    bad_code = good.ref_code.clone()
    bad_code[2, 5] = 2048  # codebooks 1..15 have 2048 entries
    bad_text = good.input_ids.clone()
    bad_text[4] = model.cfg.talker.text_vocab_size
    reqs = [dataclasses.replace(good, ref_code=bad_code), good, dataclasses.replace(good, input_ids=bad_text),
            dataclasses.replace(good, x_vector=torch.zeros(7))]
    out = build_prompts(model, reqs)
    assert isinstance(out[0], ValueError) and "ref_code" in str(out[0])
    assert isinstance(out[2], ValueError) and "input_ids" in str(out[2])
    assert isinstance(out[3], ValueError) and "x_vector" in str(out[3])
    _assert_same(out[1], reference_build_prompt(model, good), good, "good")


class _CountOps(TorchDispatchMode):
    """Every aten call; ``kernels``: those that are not views (a view launches nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.kernels: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        if not func.is_view:
            self.kernels.append(str(func))
        return func(*args, **(kwargs or {}))


def _count(build, model: Qwen3TtsModel, reqs: list[TtsInput]) -> int:
    model.special_embeds()  # cached once per weights, as in the runner (computed at allocation)
    with _CountOps() as counter:
        build(model, reqs)
    return len(counter.ops)


def _per_request(model: Qwen3TtsModel, reqs: list[TtsInput]) -> list[Prompt]:
    return [reference_build_prompt(model, r) for r in reqs]


def test_torch_op_count_does_not_grow_with_the_number_of_requests() -> None:
    model, _ = _model()
    mix = [_variants()[n] for n in ("cv_speaker_auto_instruct", "base_icl_streaming_text_longer")]
    two, sixteen = mix, mix * 8
    batched = (_count(build_prompts, model, two), _count(build_prompts, model, sixteen))
    assert batched[1] <= batched[0] + 2, batched
    # the per-request construction this replaced grows by ~25 ops per request: this test would catch it
    per_request = (_count(_per_request, model, two), _count(_per_request, model, sixteen))
    assert per_request[1] > per_request[0] + 14 * 20, per_request
    print(f"aten calls for 2 / 16 requests: batched {batched}, per request {per_request}")


@dataclasses.dataclass
class _Payload:
    inputs: TtsInput
    prompt: Prompt | None = None


def _admission_plan(reqs: list[TtsInput]) -> ArStepPlan:
    return ArStepPlan(0, [], [ArNew(f"r{slot}", slot, _Payload(r)) for slot, r in enumerate(reqs)])


def test_runner_admits_a_step_with_one_batched_build() -> None:
    """``TalkerSteps.run`` builds every new request's prompt together and installs prompts and trailing text
    in the right slots; a bad request fails alone with the message the per-request build raises."""
    model, _ = _model()
    good, bad = _variants(), _bad()
    reqs = [*good.values(), bad["unknown_speaker"], good["cv_streaming_short"]]
    steps = TalkerSteps(model, torch.device("cpu"), len(reqs), 256, None, None)
    try:
        _, _, errors = steps.run(_admission_plan(reqs))
        assert errors is None  # no seqs in this plan; the failure is recorded for the slot's later pieces
        bad_slot = len(good)
        with pytest.raises(ValueError) as want_error:
            reference_build_prompt(model, bad["unknown_speaker"])
        assert steps.failed == {bad_slot: f"ValueError: {want_error.value}"}
        state = steps.state
        for slot, req in enumerate(reqs):
            if slot == bad_slot:
                assert slot not in state.prompts
                continue
            want = reference_build_prompt(model, req)
            got = Prompt(embeds=state.prompts[slot], trailing=state.cache.trailing[slot, : want.trailing.shape[0]])
            _assert_same(got, want, req, f"slot {slot}")
            assert state.cache.trailing_len[slot].item() == want.trailing.shape[0]
            assert (slot in steps.context) == req.is_icl
    finally:
        model.cache = None


def test_runner_admission_op_count_does_not_grow_with_the_number_of_requests() -> None:
    """The whole admission of a step (prompts, slot resets, sampling parameters) in a fixed number of ops."""
    model, _ = _model()
    mix = [_variants()[n] for n in ("cv_speaker_auto_instruct", "base_icl_streaming_text_longer")]
    steps = TalkerSteps(model, torch.device("cpu"), 16, 256, None, None)
    try:
        counts = []
        for reqs in (mix, mix * 8):
            plan = _admission_plan(reqs)
            with _CountOps() as counter:
                steps.run(plan)
            counts.append(len(counter.kernels))
        # non-view ops only: the runner keeps each clone's reference codes on the host (``context``: one
        # ``numpy()`` each, a detach that launches nothing)
        assert counts[1] <= counts[0] + 2, counts
    finally:
        model.cache = None
