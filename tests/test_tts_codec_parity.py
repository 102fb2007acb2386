"""Speech tokenizer (decoder + encoder) and speaker encoder against the qwen-tts reference fixtures."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from omniloop.models.qwen3_tts.speaker_encoder import SpeakerEncoder
from omniloop.models.qwen3_tts.speech_config import SpeechTokenizerConfig
from omniloop.models.qwen3_tts.speech_tokenizer import SpeechTokenizer

SHAPES = ("a", "b")


def rel_l2(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def speech(tts_fixtures) -> dict[str, SpeechTokenizer]:
    return {s: SpeechTokenizer.load(tts_fixtures.ckpt(s, "base")) for s in SHAPES}


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_reference_forward(tts_fixtures, speech, shape: str) -> None:
    ref = tts_fixtures.codec(shape)
    codes = torch.from_numpy(ref["codes"])
    pcm = speech[shape].decoder.decode(codes[None])[0].numpy()
    assert pcm.dtype == np.float32 and pcm.shape == (1920 * codes.shape[0],)
    assert rel_l2(pcm, ref["wav_forward"]) < 1e-4
    # The wrapper's chunked_decode(300, 25) is one forward for <= 300 frames, so both references agree.
    assert codes.shape[0] <= 300
    np.testing.assert_array_equal(ref["wav_chunked"], ref["wav_forward"])


@pytest.mark.parametrize("shape", SHAPES)
def test_encode_matches_reference(tts_fixtures, speech, shape: str) -> None:
    ref = tts_fixtures.codec(shape)
    codes = speech[shape].encoder.encode(ref["enc_audio"]).numpy()
    assert codes.shape == (-(-ref["enc_audio"].shape[0] // 1920), 16)
    np.testing.assert_array_equal(codes, ref["enc_codes"])
    icl = tts_fixtures.case(shape, "base_icl")
    np.testing.assert_array_equal(speech[shape].encoder.encode(icl["ref_wav"]).numpy(), icl["ref_code"])


@pytest.mark.parametrize("shape", SHAPES)
def test_speaker_embedding_matches_reference(tts_fixtures, shape: str) -> None:
    enc = SpeakerEncoder.load(tts_fixtures.ckpt(shape, "base"))
    ref = tts_fixtures.codec(shape)
    emb = enc.embed(ref["spk_audio"])
    assert emb.dtype == np.float32 and emb.shape == ref["spk_embedding"].shape
    assert rel_l2(emb, ref["spk_embedding"]) < 1e-5
    icl = tts_fixtures.case(shape, "base_icl")
    assert rel_l2(enc.embed(icl["ref_wav"]), icl["x_vector"]) < 1e-5


def test_speaker_encoder_absent_from_custom_voice_is_named(tts_fixtures) -> None:
    with pytest.raises(KeyError, match="speaker_encoder"):
        SpeakerEncoder.load(tts_fixtures.ckpt("a", "custom_voice"))


def test_dummy_load_is_deterministic_and_sized(tts_fixtures) -> None:
    cfg = SpeechTokenizerConfig.from_dir(tts_fixtures.ckpt("a", "base") / "speech_tokenizer")
    codes = torch.randint(0, 2048, (1, 3, 16), generator=torch.Generator().manual_seed(0))
    one = SpeechTokenizer.build(cfg, load_format="dummy", with_encoder=False).decoder.decode(codes)
    two = SpeechTokenizer.build(cfg, load_format="dummy", with_encoder=False).decoder.decode(codes)
    assert one.shape == (1, 3 * 1920) and torch.isfinite(one).all()
    assert torch.equal(one, two)


def test_load_errors_name_the_field_and_key(tts_fixtures, tmp_path: Path) -> None:
    src = tts_fixtures.ckpt("a", "base") / "speech_tokenizer"
    dst = tmp_path / "speech_tokenizer"
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    del raw["decoder_config"]["latent_dim"]
    (dst / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="decoder_config"):
        SpeechTokenizer.load(tmp_path)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["decoder.pre_conv.conv.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(KeyError, match="decoder.pre_conv.conv.weight"):
        SpeechTokenizer.load(tmp_path)
