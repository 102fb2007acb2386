"""The CUDA talker runner: graph replay of the decode frame step (talker decode + code predictor loop +
sampling + next input) equals the same step run eagerly, over several (batch, kv) buckets, and
seeded requests sample the same codes alone and in a batch of 8 under graphs.

float32: codes exactly equal (graphs vs eager vs ``generate``). bf16: replay is deterministic and the
prefill frame (same eager kernels) is equal; the fraction of later frames equal to eager is printed,
not asserted: kernels at a kv bucket reduce over a different length than eager's exact length, and
bf16 rounding can flip a near-tie that compounds autoregressively.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch

from omniloop.models.qwen3_tts.checkpoint import build_model
from omniloop.models.qwen3_tts.config import load_tts_config
from omniloop.models.qwen3_tts.talker import Qwen3TtsModel
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint
from tests.test_talker_runner import SEEDED, Job, _expected, _input, _prompt_len, _run

pytestmark = pytest.mark.gpu
BUCKETS = ((1, 2, 4, 8), (64, 128))  # rows 0..7; contexts cross 64 so both kv buckets replay
MAX_LEN = 128


@cache
def _cuda_model(dtype: torch.dtype) -> Qwen3TtsModel:
    cfg = load_tts_config(ensure_tiny_checkpoint("custom_voice"))
    return build_model(cfg=cfg, load_format="dummy", seed=1, device="cuda", dtype=dtype)[0]


def _jobs() -> list[Job]:
    texts = ("First request on slot zero.", "Slot three, greedy.", "Slot five, seeded and longer.")
    inputs = [_input(texts[0], 40), _input(texts[1], 12), _input(texts[2], 45, SEEDED, seed=5)]
    lens = [_prompt_len(i) for i in inputs]
    # slot 5 alone uses bucket 8, slots 0+3 bucket 4, slot 0 alone bucket 1; slot 0 chunks its prompt
    return [Job("a", 0, inputs[0], [10, lens[0] - 10], 40), Job("b", 3, inputs[1], [lens[1]], 12),
            Job("c", 5, inputs[2], [lens[2]], 45)]


def test_graph_replay_equals_eager_float32() -> None:
    model = _cuda_model(torch.float32)
    graphs = _run(_jobs(), 8, MAX_LEN, model=model, device="cuda", use_cuda_graphs=True, graph_buckets=BUCKETS)
    eager = _run(_jobs(), 8, MAX_LEN, model=model, device="cuda", use_cuda_graphs=False)
    for job in _jobs():
        assert torch.equal(graphs[job.req_id], eager[job.req_id]), job.req_id
        assert torch.equal(graphs[job.req_id], _expected(job.inp, model)), job.req_id


def test_seeded_alone_equals_batch_of_8_under_graphs() -> None:
    model = _cuda_model(torch.float32)
    inputs = [_input(f"Seeded request number {i}.", 10, SEEDED, seed=100 + i) for i in range(8)]
    jobs = [Job(f"r{i}", i, inp, [_prompt_len(inp)], 10) for i, inp in enumerate(inputs)]
    batch = _run(jobs, 8, MAX_LEN, model=model, device="cuda", use_cuda_graphs=True, graph_buckets=BUCKETS)
    for i, inp in enumerate(inputs):
        alone = _run([Job("x", 7 - i, inp, [_prompt_len(inp)], 10)], 8, MAX_LEN, model=model, device="cuda",
                     use_cuda_graphs=True, graph_buckets=BUCKETS)["x"]
        assert torch.equal(alone, batch[f"r{i}"]), i
    assert len({tuple(c[0].tolist()) for c in batch.values()}) > 1  # different seeds, different codes


@pytest.mark.parametrize("fresh", [True, False])
def test_bf16_graphs_are_deterministic_and_track_eager(monkeypatch: pytest.MonkeyPatch, fresh: bool) -> None:
    """With and without the q/k norm+rope and KV write inside the decode attention (``FUSED_QKV_ATTENTION``;
    where the test model's head dim allows it): the captured frame replays deterministically and its first
    frames equal the eager run of the same kernels."""
    from omniloop.models.qwen3_tts import layers

    monkeypatch.setattr(layers, "FUSED_QKV_ATTENTION", fresh)
    model = _cuda_model(torch.bfloat16)
    kw = dict(model=model, device="cuda", graph_buckets=BUCKETS)
    one = _run(_jobs(), 8, MAX_LEN, use_cuda_graphs=True, **kw)
    two = _run(_jobs(), 8, MAX_LEN, use_cuda_graphs=True, **kw)
    eager = _run(_jobs(), 8, MAX_LEN, use_cuda_graphs=False, **kw)
    for job in _jobs():
        assert torch.equal(one[job.req_id], two[job.req_id])
        assert torch.equal(one[job.req_id][0], eager[job.req_id][0])
        same = (one[job.req_id] == eager[job.req_id]).all(1).float().mean().item()
        print(f"bf16 {job.req_id}: {same:.0%} of frames equal to eager")


def test_plans_never_synchronize_the_host() -> None:
    """Admission (prompt building, slot reset), prefill and decode plans enqueue work without waiting for
    the device: any host sync would stall the loop thread behind the step in flight. A scalar written into
    a device tensor (``t[slot] = x``) is such a sync; this catches it (sync debug mode raises)."""
    from omniloop.gpu.talker_runner import TalkerSteps
    from omniloop.scheduler.plan import ArNew, ArSeq, ArStepPlan
    from tests.test_talker_runner import Payload

    model = _cuda_model(torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        steps = TalkerSteps(model, torch.device("cuda"), 8, MAX_LEN, BUCKETS, stream)
    stream.synchronize()
    inputs = [_input("A request that must not sync.", 4, SEEDED, seed=3), _input("Greedy one.", 4)]
    lens = [_prompt_len(i) for i in inputs]
    admit = ArStepPlan(0, [ArSeq(f"r{i}", 2 * i, 0, n, True, False) for i, n in enumerate(lens)],
                       [ArNew(f"r{i}", 2 * i, Payload(inp)) for i, inp in enumerate(inputs)])
    decode = ArStepPlan(1, [ArSeq(f"r{i}", 2 * i, n, 1, True, True) for i, n in enumerate(lens)])
    try:
        with torch.cuda.stream(stream):
            torch.cuda.set_sync_debug_mode("error")
            try:
                outs = [steps.run(plan) for plan in (admit, decode)]
            finally:
                torch.cuda.set_sync_debug_mode("default")
        stream.synchronize()
        for codes, _, errors in outs:
            assert errors is None and codes.shape == (2, 16)
    finally:
        model.cache = None


def test_prefill_graphs_equal_the_eager_prefill_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces from position 0 go through a captured prefill graph (padded to its bucket), later pieces of a
    chunked prompt eagerly; codes equal the all-eager prefill and ``generate`` in float32. The padded
    (rows x tokens) graphs: the packed ones (the default) have the next test."""
    from omniloop.gpu import prefill_graphs
    from omniloop.gpu.prefill_graphs import PrefillGraphs

    monkeypatch.setattr(prefill_graphs, "PACKED", False)
    model = _cuda_model(torch.float32)
    replays: list[tuple[int, int]] = []
    original = PrefillGraphs.run

    def counted(self, bucket, pieces, slots):  # noqa: ANN001, ANN202
        replays.append(bucket)
        return original(self, bucket, pieces, slots)

    monkeypatch.setattr(PrefillGraphs, "run", counted)
    kw = dict(model=model, device="cuda", use_cuda_graphs=True, graph_buckets=BUCKETS)
    graphed = _run(_jobs(), 8, MAX_LEN, **kw)
    assert replays, "no prefill went through a graph"
    assert all(rows * tokens <= 8 * MAX_LEN for rows, tokens in replays)
    eager = _run(_jobs(), 8, MAX_LEN, prefill_graphs=False, **kw)
    for job in _jobs():
        assert torch.equal(graphed[job.req_id], eager[job.req_id]), job.req_id
        assert torch.equal(graphed[job.req_id], _expected(job.inp, model)), job.req_id


def test_packed_prefill_graphs_equal_the_eager_prefill_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """``OMNILOOP_PACKED_PREFILL``: whole prompts laid end to end in one token-bucket graph (packed causal
    attention, no row or token padding per prompt); codes equal the all-eager prefill and ``generate`` in
    float32; a bf16 run replays deterministically (the share of its frames equal to the padded graphs' is
    printed: bf16 rounding differs between the two attention kernels)."""
    from omniloop.gpu import prefill_graphs
    from omniloop.gpu.prefill_graphs import PackedPrefillGraphs

    replays: list[int] = []
    original = PackedPrefillGraphs.run

    def counted(self, bucket, pieces, slots):  # noqa: ANN001, ANN202
        replays.append(bucket)
        return original(self, bucket, pieces, slots)

    monkeypatch.setattr(PackedPrefillGraphs, "run", counted)
    monkeypatch.setattr(prefill_graphs, "PACKED", True)
    model = _cuda_model(torch.float32)
    kw = dict(model=model, device="cuda", use_cuda_graphs=True, graph_buckets=BUCKETS)
    graphed = _run(_jobs(), 8, MAX_LEN, **kw)
    assert replays, "no prefill went through a packed graph"
    eager = _run(_jobs(), 8, MAX_LEN, prefill_graphs=False, **kw)
    for job in _jobs():
        assert torch.equal(graphed[job.req_id], eager[job.req_id]), job.req_id
        assert torch.equal(graphed[job.req_id], _expected(job.inp, model)), job.req_id
    bf16 = dict(kw, model=_cuda_model(torch.bfloat16))
    one, two = _run(_jobs(), 8, MAX_LEN, **bf16), _run(_jobs(), 8, MAX_LEN, **bf16)
    monkeypatch.setattr(prefill_graphs, "PACKED", False)
    padded = _run(_jobs(), 8, MAX_LEN, **bf16)
    for job in _jobs():
        assert torch.equal(one[job.req_id], two[job.req_id]), job.req_id
        same = (one[job.req_id] == padded[job.req_id]).all(1).float().mean().item()
        print(f"bf16 {job.req_id}: {same:.0%} of frames equal to the padded prefill graphs")
