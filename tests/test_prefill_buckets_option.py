"""The talker's ``prefill_token_buckets`` option (the prompt-length buckets of the captured prefill graphs):
checked at start with an error naming the option, so a bad ``--set`` never reaches graph capture."""

from __future__ import annotations

import pytest

from omniloop.gpu.prefill_graphs import TOKEN_BUCKETS, check_token_buckets
from omniloop.models.qwen3_tts.stage_talker import build_talker
from omniloop.profile import load_profile


def test_buckets_must_be_positive_and_strictly_increasing():
    assert check_token_buckets([32, 224, 256]) == (32, 224, 256)
    assert check_token_buckets(TOKEN_BUCKETS) == TOKEN_BUCKETS
    for bad in ([], [0, 32], [64, 32], [32, 32]):
        with pytest.raises(ValueError, match="strictly increasing"):
            check_token_buckets(bad)


@pytest.mark.parametrize("value", ["[64, 32]", "7", "[a, b]"])
def test_a_bad_option_names_itself_at_start(value: str):
    profile = load_profile("qwen3_tts", [f"stages.talker.options.prefill_token_buckets={value}"], platform="cpu")
    with pytest.raises(ValueError, match="stage 'talker': option prefill_token_buckets"):
        build_talker(profile.stage("talker"), profile)


async def test_a_valid_option_is_accepted():
    profile = load_profile("qwen3_tts", ["stages.talker.options.prefill_token_buckets=[32, 96, 224, 4096]"],
                           platform="cpu")
    worker = build_talker(profile.stage("talker"), profile)
    worker.runner.close()


@pytest.mark.parametrize("packed, token_buckets, want", [
    (True, None, "packed"),  # the default
    (True, (32, 96, 224), "padded"),  # a tuned bucket list is the padded graphs' and is honoured
    (False, None, "padded"),  # OMNILOOP_PACKED_PREFILL=0
])
def test_the_prefill_graphs_honour_a_given_bucket_list(monkeypatch: pytest.MonkeyPatch, packed: bool,
                                                       token_buckets: tuple[int, ...] | None, want: str) -> None:
    from omniloop.gpu import prefill_graphs

    built = []
    monkeypatch.setattr(prefill_graphs, "PACKED", packed)
    monkeypatch.setattr(prefill_graphs, "PackedPrefillGraphs", lambda state, stream: built.append(("packed", None)))
    monkeypatch.setattr(prefill_graphs, "PrefillGraphs", lambda state, stream, max_rows, token_buckets: built.append(
        ("padded", token_buckets)))
    prefill_graphs.build_prefill_graphs(None, None, 8, token_buckets)
    assert built == [(want, None if want == "packed" else token_buckets or TOKEN_BUCKETS)]
