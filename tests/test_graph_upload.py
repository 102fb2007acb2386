"""The talker's graphs are run at start more than once: the warm-up before each capture, and the upload replay
after it (``cuda_graphs.capture(..., upload=True)``). That is safe only if running the captured frame step and
prefill forwards from the state the capture code sets up changes no slot's state: here, on CPU, with the real
``FrameGraphs`` / ``PackedPrefillGraphs`` set-up code and a capture stand-in that runs the step three times, over
slots holding live-looking state (KV, trailing text, code-0 history, frame counters, next inputs)."""

from __future__ import annotations

import pytest
import torch

from omniloop.gpu import cuda_graphs, prefill_graphs
from omniloop.gpu.cuda_graphs import FrameGraphs
from omniloop.gpu.prefill_graphs import PackedPrefillGraphs
from omniloop.gpu.talker_state import TalkerState
from tests.test_talker_runner import _model

NUM_SLOTS, MAX_LEN = 4, 64


def _capture_runs_thrice(fn, stream, pool, upload=False):  # noqa: ANN001, ANN202
    fn()  # warm-up
    out = fn()  # what a capture records (on CUDA it does not run; here it does, to be strict)
    if upload:
        fn()
    return None, out


def _live_state() -> TalkerState:
    model, _ = _model()
    state = TalkerState.allocate(model, NUM_SLOTS, MAX_LEN, max_trailing=16)
    g = torch.Generator().manual_seed(0)
    cache = state.cache
    for t in (cache.k, cache.v, cache.trailing, state.next_input, state.pending_hidden):
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))
    cache.seen.copy_(torch.rand(cache.seen.shape, generator=g) < 0.1)
    cache.trailing_len.copy_(torch.tensor([3, 0, 16, 7]))
    state.step.copy_(torch.tensor([5, 0, 12, 40]))
    return state


def _slot_state(state: TalkerState) -> dict[str, torch.Tensor]:
    """Everything a slot's request reads later; the KV without the scratch position (where masked rows write)."""
    c = state.cache
    return {"k": c.k[..., :MAX_LEN, :].clone(), "v": c.v[..., :MAX_LEN, :].clone(), "trailing": c.trailing.clone(),
            "trailing_len": c.trailing_len.clone(), "seen": c.seen.clone(), "step": state.step.clone(),
            "next_input": state.next_input.clone(), "pending_hidden": state.pending_hidden.clone(),
            **{f"param.{k}": v.clone() for k, v in vars(state.params).items() if isinstance(v, torch.Tensor)}}


def _assert_same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert not changed, f"running the captured steps again changed {changed}"


@pytest.fixture
def no_cuda_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graphs, "capture", _capture_runs_thrice)
    monkeypatch.setattr(prefill_graphs, "capture", _capture_runs_thrice)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def test_frame_graphs_set_up_leaves_every_slot_as_it_was(no_cuda_capture: None) -> None:
    state = _live_state()
    state.active.fill_(True)  # left over from serving: the set-up must mask every row itself
    state.fresh[1] = True
    state.positions.copy_(torch.tensor([7, 0, 20, 41]))
    before = _slot_state(state)
    graphs = FrameGraphs(state, None, batch=(1, 2, NUM_SLOTS), kv=(32, MAX_LEN))
    assert graphs.num_graphs == 6
    _assert_same(before, _slot_state(state))


def test_packed_prefill_set_up_leaves_every_slot_as_it_was(no_cuda_capture: None) -> None:
    state = _live_state()
    before = _slot_state(state)
    graphs = PackedPrefillGraphs(state, None, max_tokens=32, buckets=(16, 32))
    assert graphs.num_graphs == 2
    _assert_same(before, _slot_state(state))


def test_the_check_sees_a_step_that_does_change_a_slot(no_cuda_capture: None) -> None:
    """The same check, with one row left active: its frame counter and next input move (the check can fail)."""
    state = _live_state()
    before = _slot_state(state)
    with torch.no_grad():
        state.active.zero_()
        state.active[2] = True
        state.positions.fill_(MAX_LEN)
        state.positions[2] = 12
        state.decode_frame(NUM_SLOTS, MAX_LEN)
    with pytest.raises(AssertionError, match="step"):
        _assert_same(before, _slot_state(state))
