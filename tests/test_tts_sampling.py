"""Sampling rules (top-k, top-p, min_new_tokens, suppression, repetition penalty) and the counter-based
generator: a seeded request samples the same codes alone or in any batch."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from omniloop.models.qwen3_tts.checkpoint import build_model
from omniloop.models.qwen3_tts.generate import generate
from omniloop.models.qwen3_tts.prompt import TtsInput
from omniloop.models.qwen3_tts.sampling import (
    MIN_NEW_TOKENS, NUM_SUPPRESSED, code0_logits, counter_uniform, filter_logits, sample)

EOS = 2150
VOCAB = 3072


def _rows(n: int, **kw) -> dict[str, torch.Tensor]:
    base = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    base.update(kw)
    return dict(do_sample=torch.full((n,), base["do_sample"]), temperature=torch.full((n,), float(base["temperature"])),
                top_k=torch.full((n,), int(base["top_k"])), top_p=torch.full((n,), float(base["top_p"])))


def test_counter_uniform_depends_only_on_its_counters() -> None:
    seeds = torch.tensor([7, 1 << 40, -3, 7])
    steps = torch.tensor([0, 5, 2, 0])
    u = counter_uniform(seeds, steps, 3, 1000)
    assert torch.equal(u[0], u[3])  # same (seed, step, group) -> same numbers, whatever the row
    assert torch.equal(counter_uniform(seeds[1:2], steps[1:2], 3, 1000)[0], u[1])  # alone == in a batch
    assert not torch.equal(u[0], counter_uniform(seeds[:1], steps[:1], 4, 1000)[0])  # group matters
    assert not torch.equal(u[0], counter_uniform(seeds[:1], steps[:1] + 1, 3, 1000)[0])  # step matters
    assert (u > 0).all() and (u < 1).all()
    assert abs(float(u.mean()) - 0.5) < 0.02


def test_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 20000
    p = _rows(n, temperature=0.7)
    draws = sample(logits.expand(n, -1), p["do_sample"], p["temperature"], p["top_k"], p["top_p"],
                   torch.arange(n), torch.zeros(n, dtype=torch.int64), 0)
    freq = torch.bincount(draws, minlength=4).float() / n
    assert torch.allclose(freq, (logits / 0.7).softmax(-1), atol=0.015)


def test_top_k_and_top_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = torch.ones(1)
    k2 = filter_logits(logits, one, torch.tensor([2]), one)
    assert torch.isfinite(k2).tolist() == [[True, True, False, False]]
    p07 = filter_logits(logits, one, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.isfinite(p07).tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.8
    p05 = filter_logits(logits, one, torch.tensor([0]), torch.tensor([0.5]))
    assert torch.isfinite(p05).tolist() == [[True, False, False, False]]
    n = 4000
    p = _rows(n, top_k=2)
    draws = sample(logits.expand(n, -1), p["do_sample"], p["temperature"], p["top_k"], p["top_p"],
                   torch.arange(n), torch.zeros(n, dtype=torch.int64), 0)
    assert set(draws.tolist()) == {0, 1}


def test_code0_rules_min_new_tokens_suppression_and_penalty() -> None:
    logits = torch.full((3, VOCAB), 1.0)
    logits[:, 5] = -2.0
    seen = torch.zeros(3, VOCAB, dtype=torch.bool)
    seen[:, 4:6] = True
    out = code0_logits(logits, seen, torch.tensor([0, 1, MIN_NEW_TOKENS]), torch.full((3,), 2.0), EOS)
    assert torch.isinf(out[:2, EOS]).all() and torch.isfinite(out[2, EOS])  # EOS allowed from token 2 on
    suppressed = torch.arange(VOCAB - NUM_SUPPRESSED, VOCAB) != EOS
    assert torch.isinf(out[:, VOCAB - NUM_SUPPRESSED:][:, suppressed]).all()
    assert torch.isfinite(out[:, : VOCAB - NUM_SUPPRESSED]).all()
    assert out[0, 4] == 0.5 and out[0, 5] == -4.0 and out[0, 6] == 1.0  # divide positive, multiply negative


def test_greedy_rows_stay_greedy_in_a_sampled_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    p = _rows(6, temperature=2.0)
    p["do_sample"] = torch.tensor([True, False, True, False, True, False])
    out = sample(logits, p["do_sample"], p["temperature"], p["top_k"], p["top_p"], torch.arange(6),
                 torch.zeros(6, dtype=torch.int64), 0)
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))


@cache
def _model(ckpt):
    torch.set_num_threads(1)
    return build_model(ckpt)[0]


def _sampled(ids: torch.Tensor, seed: int, max_new_tokens: int, **kw) -> TtsInput:
    sampling = dict(do_sample=True, temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.05,
                    sub_do_sample=True, sub_temperature=0.9, sub_top_k=50, sub_top_p=1.0)
    return TtsInput(task="voice_design", input_ids=ids, language="english", max_new_tokens=max_new_tokens,
                    sampling=sampling, seed=seed, **kw)


def test_seeded_request_same_alone_and_in_batches(tts_fixtures) -> None:
    case = tts_fixtures.case("a", "voice_design")
    model = _model(tts_fixtures.ckpt("a", "voice_design"))
    ids = torch.from_numpy(case["input_ids"])
    target = _sampled(ids, seed=42, max_new_tokens=10)
    alone = generate(model, [target])[0]
    greedy_neighbour = TtsInput(task="voice_design", input_ids=ids[:-3].clone(), max_new_tokens=6,
                                instruct_ids=torch.from_numpy(case["instruct_ids"]))
    batch1 = generate(model, [_sampled(ids, seed=1, max_new_tokens=12), target])
    batch2 = generate(model, [greedy_neighbour, _sampled(ids, seed=2, max_new_tokens=4), target])
    assert alone.codes.shape[0] > 0
    assert torch.equal(batch1[1].codes, alone.codes)
    assert torch.equal(batch2[2].codes, alone.codes)
    assert not torch.equal(batch1[0].codes[: alone.codes.shape[0]], alone.codes)  # another seed, other codes
    assert torch.equal(batch2[0].codes, generate(model, [greedy_neighbour])[0].codes)


@pytest.mark.parametrize("bad", [dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(temperature=0.0),
                                 dict(sub_top_p=2.0), dict(repetition_penalty=0.0)])
def test_bad_sampling_values_are_refused(tts_fixtures, bad: dict) -> None:
    from omniloop.errors import RequestError
    from omniloop.models.qwen3_tts.validate import validate_speech_request
    from omniloop.transport.messages import Sampling, SpeechRequest

    cfg = _model(tts_fixtures.ckpt("a", "voice_design")).cfg
    req = SpeechRequest(text="hi", sampling=Sampling(do_sample=True, sub_do_sample=True, **bad))
    with pytest.raises(RequestError) as err:
        validate_speech_request(cfg, req)
    assert err.value.status == 400 and next(iter(bad)) in err.value.message


def test_gumbel_noise_stays_finite_so_removed_tokens_are_never_drawn() -> None:
    """A uniform of exactly 1.0 (float32 rounding of the largest counter value) must not yield +inf noise:
    +inf on a suppressed (-inf) logit is NaN, and argmax would pick that suppressed token."""
    from omniloop.models.qwen3_tts.sampling import gumbel_noise, sample_noisy

    u = torch.tensor([[0.5, 1.0, 2.0**-24]], dtype=torch.float32)
    assert torch.isfinite(gumbel_noise(u)).all()
    logits = torch.tensor([[0.0, float("-inf"), -1.0]])
    token = sample_noisy(logits, torch.tensor([True]), torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1.0]),
                         gumbel_noise(u))
    assert token.item() != 1
