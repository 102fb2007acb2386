"""Malformed checkpoint files must raise the loader's error type naming the file (and field), not a
bare ZeroDivisionError / UnicodeDecodeError / AttributeError / SafetensorError."""

import copy
import json

import pytest

from omniloop.models.qwen3_tts.checkpoint import _shard_files, load_tts_weights
from omniloop.models.qwen3_tts.config import ConfigError, load_tts_config, parse_tts_config
from omniloop.models.qwen3_tts.speech_config import read_json
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    d = ensure_tiny_checkpoint("custom_voice", cache_dir=tmp_path_factory.mktemp("tiny"))
    return json.loads((d / "config.json").read_text())


@pytest.mark.parametrize("field", ["num_attention_heads", "num_key_value_heads"])
def test_zero_heads_names_field(raw, field):
    r = copy.deepcopy(raw)
    r["talker_config"][field] = 0
    with pytest.raises(ConfigError, match=f"talker_config.{field}"):
        parse_tts_config(r)


def test_bad_nested_rope_theta_names_field(raw):
    r = copy.deepcopy(raw)
    del r["talker_config"]["rope_theta"]
    r["talker_config"]["rope_scaling"]["rope_theta"] = "x"
    with pytest.raises(ConfigError, match="rope_theta"):
        parse_tts_config(r)


def test_binary_or_directory_config_names_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="config.json"):
        load_tts_config(tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        read_json(tmp_path / "config.json")
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        load_tts_config(tmp_path)


@pytest.mark.parametrize("text", ["{bad", "[]", '{"weight_map": {"a": 3}}'])
def test_bad_index_names_file(tmp_path, text):
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ConfigError, match="model.safetensors.index.json"):
        _shard_files(tmp_path)


def test_corrupt_safetensors_names_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="model.safetensors"):
        load_tts_weights(tmp_path)
