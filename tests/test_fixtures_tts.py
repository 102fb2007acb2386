"""Sanity of the Qwen3-TTS reference fixtures that every parity test builds on."""
from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
from safetensors import safe_open

from tests.fixtures import CASES, SHAPES, VARIANTS, TtsFixtures

pytestmark = pytest.mark.parity

SAMPLES_PER_FRAME = 1920
CHECKPOINT_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json",
                    "vocab.json", "merges.txt", "speech_tokenizer/config.json",
                    "speech_tokenizer/model.safetensors", "speech_tokenizer/preprocessor_config.json")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_has_released_layout(tts_fixtures: TtsFixtures, shape: str, variant: str) -> None:
    ckpt = tts_fixtures.ckpt(shape, variant)
    missing = [f for f in CHECKPOINT_FILES if not (ckpt / f).is_file()]
    assert not missing, f"{ckpt} lacks {missing}"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["tts_model_type"] == variant
    assert "model_type" not in config.get("speaker_encoder_config", {})
    with safe_open(str(ckpt / "model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert "talker.codec_head.weight" in keys
    assert any(k.startswith("talker.code_predictor.") for k in keys)
    assert any(k.startswith("speaker_encoder.") for k in keys) == (variant == "base")


def test_shapes_cover_both_code_predictor_projections(tts_fixtures: TtsFixtures) -> None:
    projections = {}
    for shape in SHAPES:
        with safe_open(str(tts_fixtures.ckpt(shape, "base") / "model.safetensors"), "np") as f:
            projections[shape] = any("small_to_mtp_projection" in k for k in f.keys())
    assert projections == {"a": True, "b": False}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", CASES)
def test_reference_case_is_consistent(tts_fixtures: TtsFixtures, shape: str, case: str) -> None:
    ref = tts_fixtures.case(shape, case)
    codes, wav = ref["codes"], ref["wav"]
    assert codes.dtype == np.int64 and codes.ndim == 2 and codes.shape[1] == 16
    assert codes.shape[0] == ref["num_frames"] > 0
    assert ((codes >= 0) & (codes < 2048)).all(), "generated codes must be codebook entries, never specials"
    assert wav.dtype == np.float32 and np.isfinite(wav).all()
    assert np.abs(wav).max() < 1.0, "vocoder output clips; the fixture's calibration is off"
    assert ref["num_frames"] <= ref["max_new_tokens"]
    if ref["finished_by_eos"]:
        assert ref["num_frames"] == ref["num_talker_tokens"] - 1
    else:
        assert ref["num_talker_tokens"] == ref["max_new_tokens"]
    if case == "base_icl":
        # the wrapper decodes ref + generated frames and keeps the generated share of the samples
        total = ref["ref_code"].shape[0] + codes.shape[0]
        full = SAMPLES_PER_FRAME * total
        assert wav.shape[0] == full - int(ref["ref_code"].shape[0] / total * full)
        assert ref["ref_code"].shape[1] == 16 and ((ref["ref_code"] >= 0) & (ref["ref_code"] < 2048)).all()
    else:
        assert wav.shape[0] == SAMPLES_PER_FRAME * codes.shape[0]
    assert ("instruct_ids" in ref) == bool(ref["instructions"])
    assert ("ref_ids" in ref) == (case == "base_icl")
    if ref["variant"] == "base":
        assert ref["x_vector"].shape == (tts_fixtures.manifest["shapes"][shape]["shape"]["hidden"],)
        assert ref["ref_wav"].dtype == np.float32


def test_reference_audio_file_is_not_24k(tts_fixtures: TtsFixtures) -> None:
    for shape in SHAPES:
        info = sf.info(str(tts_fixtures.ref_audio_path(shape)))
        ref = tts_fixtures.case(shape, "base_icl")
        assert info.samplerate == ref["ref_audio_sr"] != 24000
        expected = info.frames * 24000 / info.samplerate
        assert abs(ref["ref_wav"].shape[0] - expected) <= 1, "ref_wav is the 24 kHz audio the reference saw"


@pytest.mark.parametrize("shape", SHAPES)
def test_codec_reference(tts_fixtures: TtsFixtures, shape: str) -> None:
    codec = tts_fixtures.codec(shape)
    frames = codec["codes"].shape[0]
    assert codec["codes"].shape == (frames, 16)
    for key in ("wav_forward", "wav_chunked", "wav_chunked_small"):
        assert codec[key].shape == (SAMPLES_PER_FRAME * frames,), key
    # with fewer frames than the reference's 300-frame chunk, chunked decoding is one forward
    np.testing.assert_array_equal(codec["wav_chunked"], codec["wav_forward"])
    assert not np.array_equal(codec["wav_chunked_small"], codec["wav_forward"]), "small chunks must differ"
    enc_frames = -(-codec["enc_audio"].shape[0] // SAMPLES_PER_FRAME)
    assert codec["enc_codes"].shape == (enc_frames, 16)
    assert ((codec["enc_codes"] >= 0) & (codec["enc_codes"] < 2048)).all()
    assert np.isfinite(codec["spk_embedding"]).all() and codec["spk_embedding"].std() > 0


def test_shapes_differ_and_cases_are_distinct(tts_fixtures: TtsFixtures) -> None:
    a = tts_fixtures.case("a", "voice_design")["codes"]
    b = tts_fixtures.case("b", "voice_design")["codes"]
    assert not np.array_equal(a, b)
    codes = [tts_fixtures.case("a", c)["codes"] for c in CASES]
    assert len({c.tobytes() for c in codes}) == len(CASES)


def test_fixture_api_rejects_unknown_names(tts_fixtures: TtsFixtures) -> None:
    with pytest.raises(KeyError, match="unknown fixture shape"):
        tts_fixtures.ckpt("z", "base")
    with pytest.raises(KeyError, match="unknown reference case"):
        tts_fixtures.case("a", "nope")


@pytest.mark.parametrize("shape", SHAPES)
def test_cases_end_both_ways(tts_fixtures: TtsFixtures, shape: str) -> None:
    meta = tts_fixtures.case_meta(shape)
    by_eos = {name for name, m in meta.items() if m["finished_by_eos"]}
    assert by_eos and by_eos != set(CASES), f"need cases ending by EOS and by length, got EOS for {sorted(by_eos)}"
    assert tts_fixtures.manifest["shapes"][shape]["reload_identical"] is True
    for name, m in meta.items():
        # recorded so a parity failure can be told apart from a near-tie the reference itself barely resolved
        assert m["min_talker_margin"] > 0 and m["min_code_predictor_margin"] > 0, name


def test_missing_reference_env_is_reported_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.fixtures as fixtures

    def no_env() -> None:
        raise fixtures.ReferenceEnvError("pip could not reach the index")

    monkeypatch.setattr(fixtures, "ensure_tts_ref_python", no_env)
    with pytest.raises(fixtures.ReferenceUnavailable, match="pip could not reach the index"):
        fixtures.load_tts_fixtures()
