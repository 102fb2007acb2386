"""A builtin profile resolves its checkpoint on every request's validation: that must reuse the layout built
once per process (a stat), not build a tokenizer per request (~1.2 ms of the frontend's GIL each on the H200,
which stalled the talker's admissions by ~70 ms per 64-request burst)."""

from types import SimpleNamespace

import pytest

from omniloop.models.qwen3_tts import family, tiny
from omniloop.transport.messages import SpeechRequest
from tests.test_review3_tiny_race import _complete


def test_validation_does_not_rebuild_the_layout(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNILOOP_CACHE", str(tmp_path / "a"))
    profile = SimpleNamespace(name="qwen3_tts", model_dir="builtin:tiny", load_format="dummy", max_text_chars=4096)
    first = family.resolve_checkpoint(profile).path
    assert _complete(first)

    def boom() -> None:
        raise AssertionError("build_tokenizer called again")

    monkeypatch.setattr(tiny, "build_tokenizer", boom)
    for _ in range(3):
        family.validate(SpeechRequest(text="hello there", speaker=sorted(family.config_of(profile).speakers)[0]),
                        profile)
    assert family.resolve_checkpoint(profile).path == first
    # another cache directory still gets the whole layout, written from the files built once
    monkeypatch.setenv("OMNILOOP_CACHE", str(tmp_path / "b"))
    second = family.resolve_checkpoint(profile).path
    assert second.parent == tmp_path / "b" and second.name == first.name and _complete(second)
    assert (second / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
