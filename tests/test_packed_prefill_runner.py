"""The talker runner with packed prefill graphs (``OMNILOOP_PACKED_PREFILL``), on the CPU: the graphs are
replaced by eager replays of the very forward they would capture (``_forward`` of each token bucket), so the
runner's side of packing (bucket choice, the packed layout, parking each prompt's last hidden from its row)
is checked here; ``test_talker_graphs_gpu.py`` replays the captured graphs on a GPU. Codes must equal the
runner without prefill graphs and ``generate``, including a prompt chunked over two plans (its later piece
runs eagerly) and a slot reused while its last step runs."""

from __future__ import annotations

import pytest
import torch

from omniloop.gpu import prefill_graphs
from omniloop.gpu import talker_runner
from omniloop.gpu.prefill_graphs import PackedPrefillGraphs
from tests.test_talker_runner import SEEDED, Job, _expected, _input, _prompt_len, _run


class _EagerGraph:
    """Stands in for a captured graph: ``replay`` runs the forward again into the same output tensor."""

    def __init__(self, fn) -> None:  # noqa: ANN001
        self.fn = fn
        self.out = fn()

    def replay(self) -> None:
        self.out.copy_(self.fn())


@pytest.fixture
def packed_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    replays: list[int] = []
    def capture(fn, stream, pool, upload=False):  # noqa: ANN001, ANN202
        graph = _EagerGraph(fn)
        if upload:  # as the real capture's upload: one more run at start, which must leave every slot as it was
            graph.replay()
        return graph, graph.out

    monkeypatch.setattr(prefill_graphs, "capture", capture)
    monkeypatch.setattr(prefill_graphs.torch.cuda, "graph_pool_handle", lambda: None)
    original_init, original_run = talker_runner.TalkerSteps.__init__, PackedPrefillGraphs.run

    def init(self, *args, **kwargs) -> None:  # noqa: ANN001
        original_init(self, *args, **kwargs)
        self.prefill_graphs = PackedPrefillGraphs(self.state, None, max_tokens=256,
                                                  buckets=(16, 32, 64, 128, 256))

    def run(self, bucket, pieces, slots):  # noqa: ANN001, ANN202
        replays.append(bucket)
        return original_run(self, bucket, pieces, slots)

    monkeypatch.setattr(talker_runner.TalkerSteps, "__init__", init)
    monkeypatch.setattr(PackedPrefillGraphs, "run", run)
    return replays


def test_packed_prefill_gives_the_codes_of_the_eager_prefill(packed_on_cpu: list[int]) -> None:
    greedy = _input("Hello there, packed runner.", frames=6)
    seeded = _input("A seeded request, packed with the others.", frames=8, sampling=SEEDED, seed=1234)
    reuse = _input("Slot zero again.", frames=5, sampling=SEEDED, seed=7)
    n_greedy, n_seeded, n_reuse = _prompt_len(greedy), _prompt_len(seeded), _prompt_len(reuse)
    jobs = [
        Job("greedy", 0, greedy, [n_greedy // 2, n_greedy - n_greedy // 2], 6),  # the later piece: eager
        Job("seeded", 2, seeded, [n_seeded], 8),
        Job("reuse", 0, reuse, [n_reuse], 5, after="greedy"),
    ]
    got = _run(jobs, max_num_seqs=4, max_len=96)
    assert packed_on_cpu, "no prefill went through the packed graphs"
    assert all(bucket in (16, 32, 64, 128, 256) for bucket in packed_on_cpu)
    for job, inp in zip(jobs, (greedy, seeded, reuse)):
        assert torch.equal(got[job.req_id], _expected(inp)), job.req_id
