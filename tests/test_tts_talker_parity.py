"""Greedy parity of our talker + code predictor with qwen-tts on the shared tiny fixtures (float32, CPU):
token ids and codes equal to the reference for every case and both shapes, and a mixed batch equal to
each request run alone."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from omniloop.models.qwen3_tts.checkpoint import build_model
from omniloop.models.qwen3_tts.generate import GREEDY, generate, tts_input_from_request
from omniloop.models.qwen3_tts.prompt import TtsInput
from omniloop.models.qwen3_tts.talker import Qwen3TtsModel
from omniloop.models.qwen3_tts.tokenizer import TextTokenizer
from omniloop.models.qwen3_tts.validate import validate_speech_request
from omniloop.transport.messages import Sampling, SpeechRequest

CASES = ("custom_voice_instruct", "custom_voice_plain", "voice_design", "base_icl", "base_xvec")
SHAPES = ("a", "b")
GREEDY_SAMPLING = Sampling(do_sample=False, sub_do_sample=False, repetition_penalty=1.0, seed=0)


@cache
def _load(ckpt: Path) -> tuple[Qwen3TtsModel, TextTokenizer]:
    torch.set_num_threads(1)
    model, _ = build_model(ckpt)
    return model, TextTokenizer.from_dir(ckpt)


def _request(case: dict) -> SpeechRequest:
    return SpeechRequest(
        text=case["text"], speaker=case["speaker"], language=case["language"], instructions=case["instructions"],
        ref_audio=b"RIFF" if case["variant"] == "base" else None, ref_text=case["ref_text"],
        x_vector_only=case["x_vector_only"], sampling=GREEDY_SAMPLING, max_frames=case["max_new_tokens"] - 1)


def _input(tts_fixtures, shape: str, name: str) -> tuple[TtsInput, dict, Qwen3TtsModel]:
    case = tts_fixtures.case(shape, name)
    model, tok = _load(tts_fixtures.ckpt(shape, case["variant"]))
    req = _request(case)
    validate_speech_request(model.cfg, req)
    x_vector = torch.from_numpy(case["x_vector"]) if "x_vector" in case else None
    ref_code = torch.from_numpy(case["ref_code"]) if "ref_code" in case else None
    return tts_input_from_request(model.cfg, tok, req, x_vector, ref_code), case, model


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", CASES)
def test_ids_and_codes_match_reference(tts_fixtures, shape: str, name: str) -> None:
    inp, case, model = _input(tts_fixtures, shape, name)
    assert inp.input_ids.tolist() == case["input_ids"].tolist()
    for key in ("instruct_ids", "ref_ids"):
        ours = getattr(inp, key)
        assert (ours.tolist() if ours is not None else None) == (case[key].tolist() if key in case else None), key
    assert inp.streaming_text == (not case["non_streaming_mode"])
    (result,) = generate(model, [inp])
    assert result.codes.shape == (case["num_frames"], 16)
    assert torch.equal(result.codes, torch.from_numpy(case["codes"]).to(torch.int64))
    assert result.reason == ("stop" if case["finished_by_eos"] else "length")


@pytest.mark.parametrize("shape", SHAPES)
def test_mixed_batch_equals_solo(tts_fixtures, shape: str) -> None:
    """Four base requests of different prompt lengths, modes and frame limits in one batch."""
    icl, icl_case, model = _input(tts_fixtures, shape, "base_icl")
    xvec, xvec_case, _ = _input(tts_fixtures, shape, "base_xvec")
    icl_nonstream = TtsInput(**{**icl.__dict__, "non_streaming": True, "max_new_tokens": 9})
    xvec_nonstream = TtsInput(**{**xvec.__dict__, "non_streaming": True, "max_new_tokens": 15})
    batch = [xvec_nonstream, icl, icl_nonstream, xvec]
    solo = [generate(model, [r])[0] for r in (xvec_nonstream, icl_nonstream)]
    together = generate(model, batch)
    assert torch.equal(together[1].codes, torch.from_numpy(icl_case["codes"]))
    assert torch.equal(together[3].codes, torch.from_numpy(xvec_case["codes"]))
    assert torch.equal(together[0].codes, solo[0].codes) and together[0].reason == solo[0].reason
    assert torch.equal(together[2].codes, solo[1].codes) and together[2].reason == solo[1].reason
    assert together[2].codes.shape[0] <= 8  # max_new_tokens 9 -> at most 8 frames


def test_custom_voice_pair_in_one_batch(tts_fixtures) -> None:
    a, a_case, model = _input(tts_fixtures, "a", "custom_voice_plain")
    b, b_case, _ = _input(tts_fixtures, "a", "custom_voice_instruct")
    out = generate(model, [a, b])
    assert torch.equal(out[0].codes, torch.from_numpy(a_case["codes"]))
    assert torch.equal(out[1].codes, torch.from_numpy(b_case["codes"]))


def test_special_embeds_follow_weight_changes(tts_fixtures) -> None:
    model, _ = build_model(tts_fixtures.ckpt("a", "voice_design"))
    before = model.special_embeds().clone()
    assert model.special_embeds() is model.special_embeds()  # cached between calls
    with torch.no_grad():
        model.talker.text_projection.linear_fc2.bias.add_(1.0)
    assert torch.allclose(model.special_embeds(), before + 1.0, atol=1e-5)


def test_greedy_rows_ignore_seed(tts_fixtures) -> None:
    inp, case, model = _input(tts_fixtures, "b", "voice_design")
    other = TtsInput(**{**inp.__dict__, "seed": 12345, "sampling": dict(GREEDY)})
    assert torch.equal(generate(model, [other])[0].codes, torch.from_numpy(case["codes"]))
