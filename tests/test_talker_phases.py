"""``TalkerSteps.phases_ms``: the host time of a plan's parts (admit, reset, prefill, frame, gather), which the
stage's trace attaches to each step of a runner that has it, to say what a long ``submit`` was made of."""

from __future__ import annotations

import time

import torch

from omniloop.gpu.talker_runner import TalkerSteps
from omniloop.scheduler.plan import ArNew, ArSeq, ArStepPlan
from tests.test_talker_runner import Payload, _input, _model, _prompt_len

PARTS = {"admit", "reset", "prefill", "frame", "gather"}


def test_each_plan_says_where_its_host_time_went() -> None:
    model, _ = _model()
    steps = TalkerSteps(model, torch.device("cpu"), max_num_seqs=2, max_len=96, graphs=None, stream=None)
    inp = _input("Where does the time go?", frames=3)
    n = _prompt_len(inp)
    admission = ArStepPlan(step_id=0, seqs=[ArSeq("r", 1, 0, n, True, False)], new=[ArNew("r", 1, Payload(inp))])
    started = time.perf_counter()
    with torch.no_grad():
        steps.run(admission)
    wall_ms = (time.perf_counter() - started) * 1e3
    first = dict(steps.phases_ms)
    assert set(first) == PARTS
    # an admission plan builds a prompt, resets the slot, prefills it and samples its first frame
    assert all(first[part] > 0.0 for part in ("admit", "reset", "prefill", "frame"))
    assert sum(first.values()) <= wall_ms + 1e-3
    decode = ArStepPlan(step_id=1, seqs=[ArSeq("r", 1, n, 1, True, True)])
    with torch.no_grad():
        steps.run(decode)
    second = steps.phases_ms
    assert set(second) == PARTS
    # a decode plan admits and prefills nothing: those parts are clock reads apart, the frame is the work
    assert second["frame"] > 2 * (second["admit"] + second["reset"] + second["prefill"])
