"""Admission resets every new slot in one batched call (``TalkerState.reset_many``); a request whose trailing
text does not fit the slot fails alone (an error row), and its neighbours in the same plan are admitted with
their own sampling parameters."""

from __future__ import annotations

import torch

from omniloop.gpu.talker_runner import TalkerSteps
from omniloop.models.qwen3_tts.prompt import Prompt, build_prompt
from omniloop.scheduler.plan import ArNew, ArSeq, ArStepPlan
from tests.test_talker_runner import SEEDED, Payload, _input, _model


def test_reset_many_sets_each_slot_and_isolates_a_bad_request() -> None:
    model, _ = _model()
    steps = TalkerSteps(model, torch.device("cpu"), 4, 96, None, None)
    try:
        good = [_input("First.", 3), _input("Second, seeded.", 3, SEEDED, seed=77)]
        prompts = [build_prompt(model, inp) for inp in good]
        too_long = Prompt(embeds=prompts[0].embeds, trailing=torch.zeros(97, prompts[0].embeds.shape[1]))
        payloads = [Payload(good[0], prompts[0]), Payload(good[0], too_long), Payload(good[1], prompts[1])]
        slots = [0, 1, 3]
        seqs = [ArSeq(f"r{s}", s, 0, p.embeds.shape[0], True, False) for s, p in zip(slots, [prompts[0], too_long, prompts[1]])]
        plan = ArStepPlan(0, seqs, [ArNew(f"r{s}", s, p) for s, p in zip(slots, payloads)])
        codes, _, errors = steps.run(plan)
        assert errors is not None and set(errors) == {1} and "max_trailing" in errors[1]
        params = steps.state.params
        assert params.seed[3].item() == 77 and params.seed[0].item() == 0
        assert bool(params.do_sample[3]) and not bool(params.do_sample[0])
        assert params.temperature[3].item() == torch.tensor(SEEDED["temperature"], dtype=torch.float32).item()
        assert params.top_k[3].item() == SEEDED["top_k"] and params.top_k[0].item() == 0
        assert steps.state.step[0].item() == 1 and steps.state.step[3].item() == 1  # first frame sampled
        assert codes.shape == (3, 16)
    finally:
        model.cache = None
