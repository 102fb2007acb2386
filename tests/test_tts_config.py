"""Config parsing, weight loading (released layout and dummy), the tokenizer fallback and request
validation for the Qwen3-TTS talker stage."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniloop.errors import RequestError
from omniloop.models.qwen3_tts.checkpoint import build_model, load_tts_weights
from omniloop.models.qwen3_tts.config import ConfigError, load_tts_config, parse_tts_config
from omniloop.models.qwen3_tts.generate import generate
from omniloop.models.qwen3_tts.prompt import TtsInput
from omniloop.models.qwen3_tts.tokenizer import TextTokenizer
from omniloop.models.qwen3_tts.validate import validate_speech_request
from omniloop.transport.messages import SpeechRequest


@pytest.fixture(scope="module")
def cv_dir(tts_fixtures) -> Path:
    return tts_fixtures.ckpt("a", "custom_voice")


@pytest.fixture(scope="module")
def raw(cv_dir) -> dict:
    return json.loads((cv_dir / "config.json").read_text())


def real_1p7b_config() -> dict:
    """Qwen3-TTS-12Hz-1.7B sizes (REFERENCE.md section 4), in the 5.x spelling with rope_parameters."""
    cp = dict(model_type="", vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
              num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_parameters=dict(
                  rope_type="default", rope_theta=1e6), num_code_groups=16)
    talker = dict(model_type="", vocab_size=3072, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_parameters=dict(
                      rope_type="default", rope_theta=1e6, mrope_section=[24, 20, 20], interleaved=True),
                  num_code_groups=16, text_hidden_size=2048, text_vocab_size=151936, code_predictor_config=cp,
                  codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_think_id=2154,
                  codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
                  codec_language_id=dict(english=2050, chinese=2055), spk_id={}, spk_is_dialect={})
    return dict(tts_model_type="base", tts_model_size="1b7", im_start_token_id=151644, im_end_token_id=151645,
                assistant_token_id=77091, tts_pad_token_id=151671, tts_bos_token_id=151672,
                tts_eos_token_id=151673, talker_config=talker, speaker_encoder_config=dict(enc_dim=2048))


def test_released_config_parses(cv_dir) -> None:
    cfg = load_tts_config(cv_dir)
    assert cfg.model_type == "custom_voice"
    assert cfg.talker.decoder.mrope_interleaved and cfg.talker.decoder.mrope_section is not None
    assert cfg.talker.code_predictor.mrope_section is None
    assert "auto" in cfg.languages and not any("dialect" in lang for lang in cfg.languages)
    assert cfg.generation.max_new_tokens == 8192 and cfg.generation.do_sample is True


def test_generation_fallbacks_without_generation_config() -> None:
    cfg = parse_tts_config(real_1p7b_config(), None)
    assert cfg.generation.max_new_tokens == 2048 and cfg.generation.repetition_penalty == 1.05


@pytest.mark.parametrize("path, value, words", [
    (("talker_config", "hidden_size"), None, ["config.json", "talker_config.hidden_size", "missing"]),
    (("talker_config", "code_predictor_config", "num_hidden_layers"), "5",
     ["talker_config.code_predictor_config.num_hidden_layers", "int"]),
    (("tts_model_type",), "music", ["tts_model_type", "music"]),
    (("talker_config", "spk_is_dialect"), {"x": "klingon"}, ["talker_config.spk_is_dialect", "klingon"]),
    (("talker_config", "num_key_value_heads"), 3, ["talker_config.num_key_value_heads"]),
])
def test_config_errors_name_file_and_field(raw, path, value, words) -> None:
    bad = copy.deepcopy(raw)
    node = bad
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    with pytest.raises(ConfigError) as err:
        parse_tts_config(bad, None, file="/ckpt/config.json")
    for word in words:
        assert word in str(err.value)


def test_missing_files_are_named(tmp_path, cv_dir) -> None:
    with pytest.raises(ConfigError, match="config.json: file not found"):
        load_tts_config(tmp_path)
    shutil.copy(cv_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(ConfigError, match=r"generation_config.json: top_p"):
        load_tts_config(tmp_path)


def test_dummy_builds_real_1p7b_shapes_on_meta() -> None:
    cfg = parse_tts_config(real_1p7b_config(), None)
    model, _ = build_model(cfg=cfg, load_format="dummy", device="meta")
    talker = sum(p.numel() for p in model.talker.parameters())
    predictor = sum(p.numel() for p in model.code_predictor.parameters())
    assert 1.70e9 < talker < 1.78e9  # 1.41 B of layers + 0.31 B text embedding + heads
    assert 0.16e9 < predictor < 0.19e9  # REFERENCE.md: 0.175 B
    assert 1.90e9 < talker + predictor < 1.94e9  # REFERENCE.md: 1.92 B for the whole talker
    assert model.code_predictor.small_to_mtp_projection.weight.shape == (1024, 2048)


def test_dummy_weights_are_deterministic_and_generate(cv_dir) -> None:
    cfg = load_tts_config(cv_dir)
    a, _ = build_model(cfg=cfg, load_format="dummy", seed=3)
    b, _ = build_model(cfg=cfg, load_format="dummy", seed=3)
    c, _ = build_model(cfg=cfg, load_format="dummy", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.talker.codec_head.weight, c.talker.codec_head.weight)
    ids = TextTokenizer.from_dir(cv_dir).assistant_ids("dummy weights")
    (out,) = generate(a, [TtsInput(task="custom_voice", input_ids=ids, speaker="ryan", max_new_tokens=4)])
    assert out.codes.shape[1] == 16 and out.codes.shape[0] <= 3 and (out.codes < 2048).all()


def test_shape_mismatch_names_key_and_shapes(tmp_path, cv_dir) -> None:
    for name in ("config.json", "generation_config.json"):
        shutil.copy(cv_dir / name, tmp_path / name)
    state = load_file(cv_dir / "model.safetensors")
    key = "talker.codec_head.weight"
    state[key] = state[key][:-1].contiguous()
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError) as err:
        build_model(tmp_path)
    assert "talker.codec_head.weight" in str(err.value) and "[3071," in str(err.value) and "[3072," in str(err.value)


def test_speaker_encoder_tensors_are_returned(tts_fixtures) -> None:
    state, speaker = load_tts_weights(tts_fixtures.ckpt("a", "base"))
    assert speaker and not any(k.startswith("speaker_encoder.") for k in speaker)
    assert "talker.model.layers.0.self_attn.q_proj.weight" in state
    assert "code_predictor.codec_embedding.0.weight" in state


def test_tokenizer_fallback_matches_tokenizer_json(tmp_path, cv_dir) -> None:
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(cv_dir / name, tmp_path / name)
    text = "Hello tiny world, 123 -- it's fine.\nA second line."
    full, fallback = TextTokenizer.from_dir(cv_dir), TextTokenizer.from_dir(tmp_path)
    assert torch.equal(full.assistant_ids(text), fallback.assistant_ids(text))
    assert torch.equal(full.instruct_ids("Speak slowly."), fallback.instruct_ids("Speak slowly."))


@pytest.mark.parametrize("fields, words", [
    (dict(text="   "), ["text is empty"]),
    (dict(text="x" * 5000), ["5000", "4096"]),
    (dict(task="voice_design"), ["custom_voice model", "voice_design"]),
    (dict(speaker="nobody"), ["nobody", "ryan"]),
    (dict(speaker=None), ["needs a speaker"]),
    (dict(language="klingon"), ["klingon", "english"]),
    (dict(ref_text="x"), ["only for task base"]),
    (dict(max_frames=0), ["max_frames"]),
])
def test_request_validation(cv_dir, fields, words) -> None:
    cfg = load_tts_config(cv_dir)
    good = dict(text="hello", speaker="Ryan", language="English")
    validate_speech_request(cfg, SpeechRequest(**good))
    with pytest.raises(RequestError) as err:
        validate_speech_request(cfg, SpeechRequest(**{**good, **fields}))
    assert err.value.status == 400
    for word in words:
        assert word in err.value.message


def test_base_validation(tts_fixtures) -> None:
    cfg = load_tts_config(tts_fixtures.ckpt("a", "base"))
    validate_speech_request(cfg, SpeechRequest(text="hi", ref_audio=b"wav", ref_text="ref"))
    validate_speech_request(cfg, SpeechRequest(text="hi", ref_audio=b"wav", x_vector_only=True))
    for req, word in ((SpeechRequest(text="hi", ref_audio=b"wav"), "ref_text"),
                      (SpeechRequest(text="hi", ref_text="ref"), "ref_audio"),
                      (SpeechRequest(text="hi", ref_audio=b"wav", ref_text="r", instructions="loud"), "instructions")):
        with pytest.raises(RequestError, match=word):
            validate_speech_request(cfg, req)


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, cv_dir) -> None:
    """A released checkpoint split into shards (model.safetensors.index.json) loads to the same tensors, and a
    shard named by the index but missing is an error naming it."""
    for name in ("config.json", "generation_config.json"):
        shutil.copy(cv_dir / name, tmp_path / name)
    state = load_file(cv_dir / "model.safetensors")
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for fname, part in shards.items():
        save_file({k: state[k].contiguous() for k in part}, tmp_path / fname)
    weight_map = {k: fname for fname, part in shards.items() for k in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    whole, _ = build_model(cv_dir)
    sharded, _ = build_model(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), sharded.state_dict().values()))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises((ConfigError, FileNotFoundError)) as err:
        build_model(tmp_path)
    assert "model-00002-of-00002.safetensors" in str(err.value)
