"""Profiles: overlays, overrides, and errors that name the key and the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.profile import ProfileError, dump_profile, load_profile

BASE = """
name: t
transport: ipc
stages:
  - {name: talker, model: fake.ar, max_num_seqs: 8}
  - {name: codec, model: fake.codec}
edges: [[talker, codec]]
platforms:
  cuda:
    stages: {talker: {device: cuda, dtype: bfloat16}}
  cpu:
    stages: {talker: {options: {step_ms: 3}}}
"""


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_platform_overlay_and_order(tmp_path: Path) -> None:
    cpu = load_profile(str(write(tmp_path, BASE)), platform="cpu")
    cuda = load_profile(str(write(tmp_path, BASE)), platform="cuda")
    assert cpu.stage("talker").device == "cpu" and cpu.stage("talker").options == {"step_ms": 3}
    assert cuda.stage("talker").device == "cuda" and cuda.stage("talker").dtype == "bfloat16"
    assert cuda.stage("talker").max_num_seqs == 8  # untouched by the overlay
    assert [s.name for s in cpu.ordered_stages()] == ["talker", "codec"]
    assert cpu.next_of("talker") == "codec" and cpu.next_of("codec") is None


def test_set_overrides_win(tmp_path: Path) -> None:
    p = load_profile(
        str(write(tmp_path, BASE)),
        ["stages.talker.max_num_seqs=32", "chunking.frames=10", "model_dir=/x"],
        platform="cpu",
    )
    assert p.stage("talker").max_num_seqs == 32
    assert p.chunking.frames == 10 and p.model_dir == "/x"


def test_base_file_overlay(tmp_path: Path) -> None:
    write(tmp_path, BASE, "base.yaml")
    child = write(tmp_path, "base: base.yaml\nname: child\nstages: {codec: {max_num_seqs: 3}}\n", "child.yaml")
    p = load_profile(str(child), platform="cpu")
    assert p.name == "child" and p.stage("codec").max_num_seqs == 3 and p.stage("talker").max_num_seqs == 8


@pytest.mark.parametrize(
    "override, needle",
    [
        ("stages.talker.max_num_seq=3", "max_num_seq"),  # unknown key, named
        ("stages.talker.max_num_seqs=lots", "max_num_seqs"),  # wrong type, named
        ("stages.nope.max_num_seqs=3", "nope"),  # unknown stage, named
        ("stages.talker.placement=cloud", "placement"),
        ("transport=carrier-pigeon", "transport"),
        ("stages.talker.max_in_flight=0", "max_in_flight"),
        ("bogus=1", "bogus"),
    ],
)
def test_errors_name_key_and_file(tmp_path: Path, override: str, needle: str) -> None:
    path = write(tmp_path, BASE)
    with pytest.raises(ProfileError) as err:
        load_profile(str(path), [override], platform="cpu")
    assert needle in str(err.value)
    assert str(path) in str(err.value) or "--set" in str(err.value)


def test_bad_edges_rejected(tmp_path: Path) -> None:
    text = BASE.replace("edges: [[talker, codec]]", "edges: [[talker, vocoder]]")
    with pytest.raises(ProfileError, match="vocoder"):
        load_profile(str(write(tmp_path, text)), platform="cpu")


def test_missing_profile_lists_known() -> None:
    with pytest.raises(ProfileError, match="not found"):
        load_profile("no-such-profile")


def test_bundled_profiles_resolve_and_dump() -> None:
    for name in ("qwen3_tts",):
        p = load_profile(name, platform="cpu")
        assert p.stage("talker").device == "cpu"
        text = dump_profile(p)
        assert "talker" in text and "platforms" not in text
    assert load_profile("qwen3_tts", platform="cuda").stage("talker").dtype == "bfloat16"


def test_stages_sharing_a_gpu_cannot_ask_for_more_than_all_of_it(tmp_path: Path) -> None:
    path = str(write(tmp_path, BASE))
    both = ["stages.talker.device=cuda", "stages.codec.device=cuda:0"]
    ok = load_profile(path, [*both, "stages.talker.gpu_memory_fraction=0.3",
                             "stages.codec.gpu_memory_fraction=0.6"], platform="cpu")
    assert ok.stage("codec").gpu_memory_fraction == 0.6
    with pytest.raises(ProfileError, match=r"talker 0.5 \+ codec 0.6 = 1.10 > 1"):
        load_profile(path, [*both, "stages.talker.gpu_memory_fraction=0.5", "stages.codec.gpu_memory_fraction=0.6"],
                     platform="cpu")
    # on different devices each may take most of its own
    load_profile(path, ["stages.talker.device=cuda:0", "stages.codec.device=cuda:1",
                        "stages.talker.gpu_memory_fraction=0.9", "stages.codec.gpu_memory_fraction=0.9"],
                 platform="cpu")
    assert load_profile("qwen3_tts", platform="cuda").stage("codec").gpu_memory_fraction == 0.6
