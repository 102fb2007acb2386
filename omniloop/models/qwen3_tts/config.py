"""Qwen3-TTS-12Hz checkpoint configuration, parsed once into frozen, typed structures.

Reads ``config.json`` (the released ``Qwen3TTSConfig`` layout) and ``generation_config.json``. Both the
4.x spelling (``rope_theta`` + ``rope_scaling``) and the 5.x spelling (``rope_parameters``) are accepted,
as are sub-configs saved with ``"model_type": ""``. Every error names the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

TASKS = ("custom_voice", "voice_design", "base")
# the wrapper's hard fallbacks when generation_config.json lacks a value
_GENERATION_FALLBACK: dict[str, Any] = dict(
    do_sample=True, top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05,
    subtalker_dosample=True, subtalker_top_k=50, subtalker_top_p=1.0, subtalker_temperature=0.9,
    max_new_tokens=2048,
)


class ConfigError(ValueError):
    """A checkpoint file is missing, malformed, or inconsistent; the message names file and field."""


@dataclass(frozen=True)
class DecoderConfig:
    """One Qwen3 decoder stack (talker or code predictor)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # M-RoPE: per-axis frequency counts (T, H, W); None = plain 1-D RoPE
    mrope_section: tuple[int, ...] | None
    mrope_interleaved: bool
    max_position_embeddings: int
    attention_bias: bool


@dataclass(frozen=True)
class TalkerConfig:
    decoder: DecoderConfig
    code_predictor: DecoderConfig
    num_code_groups: int
    text_hidden_size: int
    text_vocab_size: int
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    codec_language_id: Mapping[str, int]
    spk_id: Mapping[str, int]
    spk_is_dialect: Mapping[str, str | bool]


@dataclass(frozen=True)
class GenerationDefaults:
    """Request defaults from generation_config.json (then the wrapper's fallbacks)."""

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    sub_do_sample: bool
    sub_temperature: float
    sub_top_k: int
    sub_top_p: float
    max_new_tokens: int


@dataclass(frozen=True)
class TtsConfig:
    model_type: str  # base | custom_voice | voice_design
    model_size: str  # "1b7", "0b6", ...
    tokenizer_type: str
    im_start_id: int
    im_end_id: int
    assistant_id: int
    tts_bos_id: int
    tts_eos_id: int
    tts_pad_id: int
    talker: TalkerConfig
    speaker_encoder: Mapping[str, Any]  # raw; the speaker-encoder module parses its own part
    generation: GenerationDefaults

    @property
    def languages(self) -> tuple[str, ...]:
        """Languages a request may name, as the reference lists them ("auto" first, no dialects)."""
        return ("auto",) + tuple(k for k in self.talker.codec_language_id if "dialect" not in k)

    @property
    def speakers(self) -> tuple[str, ...]:
        return tuple(self.talker.spk_id)

    @property
    def accepts_instructions(self) -> bool:
        # qwen-tts drops instructions for the 0.6B CustomVoice model and Base never takes them
        if self.model_type == "voice_design":
            return True
        return self.model_type == "custom_voice" and self.model_size not in "0b6"


class _Fields:
    """Typed access to one JSON object; errors carry ``file: field.path``."""

    def __init__(self, data: Any, file: str, prefix: str = "") -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{file}: {prefix or '<root>'} must be an object, got {type(data).__name__}")
        self.data, self.file, self.prefix = data, file, prefix

    def where(self, key: str) -> str:
        return f"{self.file}: {self.prefix}{key}"

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise ConfigError(f"{self.where(key)} is missing")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if bool not in kinds and isinstance(value, bool) or not isinstance(value, kinds):
            names = "/".join(k.__name__ for k in kinds)
            raise ConfigError(f"{self.where(key)} must be {names}, got {value!r}")
        return value

    def sub(self, key: str) -> "_Fields":
        return _Fields(self.get(key, dict), self.file, f"{self.prefix}{key}.")


def _rope(f: _Fields) -> tuple[float, tuple[int, ...] | None, bool]:
    params = f.get("rope_parameters", dict, None)
    scaling = f.get("rope_scaling", dict, None)
    source = params if params is not None else scaling
    key = "rope_parameters" if params is not None else "rope_scaling"
    theta = f.get("rope_theta", float, None)
    if theta is None and source is not None and source.get("rope_theta") is not None:
        theta = _Fields(source, f.file, f"{f.prefix}{key}.").get("rope_theta", float)
    if theta is None:
        raise ConfigError(f"{f.where('rope_theta')} is missing (nor in rope_parameters)")
    section, interleaved = None, False
    if source is not None and source.get("mrope_section") is not None:
        raw = source["mrope_section"]
        if not isinstance(raw, list) or not all(isinstance(x, int) for x in raw):
            raise ConfigError(f"{f.where(key)}.mrope_section must be a list of ints, got {raw!r}")
        section = tuple(raw)
        interleaved = bool(source.get("interleaved", source.get("mrope_interleaved", False)))
    rope_type = (source or {}).get("rope_type", (source or {}).get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{f.where(key)}.rope_type {rope_type!r} is not supported (only 'default')")
    return theta, section, interleaved


def _decoder(f: _Fields) -> DecoderConfig:
    hidden = f.get("hidden_size", int)
    heads = f.get("num_attention_heads", int)
    kv = f.get("num_key_value_heads", int, heads)
    for key, value in (("hidden_size", hidden), ("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if value < 1:
            raise ConfigError(f"{f.where(key)}={value} must be >= 1")
    head_dim = f.get("head_dim", int, hidden // heads)
    if heads % kv:
        raise ConfigError(f"{f.where('num_key_value_heads')}={kv} does not divide num_attention_heads={heads}")
    act = f.get("hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"{f.where('hidden_act')}={act!r} is not supported (only 'silu')")
    if f.get("use_sliding_window", bool, False):
        raise ConfigError(f"{f.where('use_sliding_window')}=true is not supported")
    theta, section, interleaved = _rope(f)
    if section is not None and 2 * sum(section) != head_dim:
        raise ConfigError(f"{f.where('rope_scaling')}.mrope_section {list(section)} must sum to head_dim/2 = "
                          f"{head_dim // 2}")
    return DecoderConfig(
        vocab_size=f.get("vocab_size", int), hidden_size=hidden, intermediate_size=f.get("intermediate_size", int),
        num_layers=f.get("num_hidden_layers", int), num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        rms_norm_eps=f.get("rms_norm_eps", float, 1e-6), rope_theta=theta, mrope_section=section,
        mrope_interleaved=interleaved, max_position_embeddings=f.get("max_position_embeddings", int, 32768),
        attention_bias=f.get("attention_bias", bool, False),
    )


def _int_map(f: _Fields, key: str) -> Mapping[str, int]:
    raw = f.get(key, dict)
    for name, value in raw.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{f.where(key)}.{name} must be int, got {value!r}")
    return MappingProxyType({k.lower(): v for k, v in raw.items()})


def _talker(f: _Fields) -> TalkerConfig:
    decoder = _decoder(f)
    cp_fields = f.sub("code_predictor_config")
    cp = _decoder(cp_fields)
    groups = f.get("num_code_groups", int)
    if cp_fields.get("num_code_groups", int, groups) != groups:
        raise ConfigError(f"{cp_fields.where('num_code_groups')} differs from talker_config.num_code_groups={groups}")
    langs = _int_map(f, "codec_language_id")
    spk = _int_map(f, "spk_id")
    dialect_raw = f.get("spk_is_dialect", dict)
    dialect: dict[str, str | bool] = {}
    for name, value in dialect_raw.items():
        if value is not False and (not isinstance(value, str) or value.lower() not in langs):
            raise ConfigError(f"{f.where('spk_is_dialect')}.{name}={value!r} must be false or a codec_language_id key")
        dialect[name.lower()] = value.lower() if isinstance(value, str) else False
    ids = {k: f.get(k, int) for k in ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_think_id",
                                      "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id")}
    for key, value in ids.items():
        if not 0 <= value < decoder.vocab_size:
            raise ConfigError(f"{f.where(key)}={value} outside the codec vocab [0, {decoder.vocab_size})")
    return TalkerConfig(
        decoder=decoder, code_predictor=cp, num_code_groups=groups,
        text_hidden_size=f.get("text_hidden_size", int), text_vocab_size=f.get("text_vocab_size", int),
        codec_pad_id=ids["codec_pad_id"], codec_bos_id=ids["codec_bos_id"], codec_eos_id=ids["codec_eos_token_id"],
        codec_think_id=ids["codec_think_id"], codec_nothink_id=ids["codec_nothink_id"],
        codec_think_bos_id=ids["codec_think_bos_id"], codec_think_eos_id=ids["codec_think_eos_id"],
        codec_language_id=langs, spk_id=spk, spk_is_dialect=MappingProxyType(dialect),
    )


def parse_generation_config(raw: dict[str, Any] | None, file: str = "generation_config.json") -> GenerationDefaults:
    f = _Fields(raw or {}, file)
    fb = _GENERATION_FALLBACK

    def pick(key: str, kind: type) -> Any:
        return f.get(key, kind, fb[key])

    gen = GenerationDefaults(
        do_sample=pick("do_sample", bool), temperature=pick("temperature", float), top_k=pick("top_k", int),
        top_p=pick("top_p", float), repetition_penalty=pick("repetition_penalty", float),
        sub_do_sample=pick("subtalker_dosample", bool), sub_temperature=pick("subtalker_temperature", float),
        sub_top_k=pick("subtalker_top_k", int), sub_top_p=pick("subtalker_top_p", float),
        max_new_tokens=pick("max_new_tokens", int),
    )
    for key, value in (("temperature", gen.temperature), ("subtalker_temperature", gen.sub_temperature)):
        if value <= 0:
            raise ConfigError(f"{f.where(key)}={value} must be > 0")
    for key, value in (("top_p", gen.top_p), ("subtalker_top_p", gen.sub_top_p)):
        if not 0 < value <= 1:
            raise ConfigError(f"{f.where(key)}={value} must be in (0, 1]")
    if gen.max_new_tokens < 1:
        raise ConfigError(f"{f.where('max_new_tokens')}={gen.max_new_tokens} must be >= 1")
    return gen


def parse_tts_config(raw: dict[str, Any], generation: dict[str, Any] | None = None, file: str = "config.json",
                     generation_file: str = "generation_config.json") -> TtsConfig:
    f = _Fields(raw, file)
    model_type = f.get("tts_model_type", str)
    if model_type not in TASKS:
        raise ConfigError(f"{f.where('tts_model_type')}={model_type!r} must be one of {list(TASKS)}")
    talker = _talker(f.sub("talker_config"))
    cfg = TtsConfig(
        model_type=model_type, model_size=f.get("tts_model_size", str, ""),
        tokenizer_type=f.get("tokenizer_type", str, "qwen3_tts_tokenizer_12hz"),
        im_start_id=f.get("im_start_token_id", int), im_end_id=f.get("im_end_token_id", int),
        assistant_id=f.get("assistant_token_id", int), tts_bos_id=f.get("tts_bos_token_id", int),
        tts_eos_id=f.get("tts_eos_token_id", int), tts_pad_id=f.get("tts_pad_token_id", int),
        talker=talker, speaker_encoder=MappingProxyType(dict(f.get("speaker_encoder_config", dict, {}))),
        generation=parse_generation_config(generation, generation_file),
    )
    for key in ("tts_bos_token_id", "tts_eos_token_id", "tts_pad_token_id", "im_start_token_id"):
        if not 0 <= raw[key] < talker.text_vocab_size:
            raise ConfigError(f"{f.where(key)}={raw[key]} outside talker_config.text_vocab_size={talker.text_vocab_size}")
    if model_type == "custom_voice" and not talker.spk_id:
        raise ConfigError(f"{file}: talker_config.spk_id is empty for a custom_voice checkpoint")
    return cfg


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:  # a directory, no permission, not UTF-8 text
        raise ConfigError(f"{path}: cannot read ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be an object")
    return data


def load_tts_config(model_dir: str | Path) -> TtsConfig:
    """Parse ``model_dir/config.json`` and (optional) ``model_dir/generation_config.json``."""
    model_dir = Path(model_dir)
    gen_path = model_dir / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.exists() else None
    cfg_path = model_dir / "config.json"
    return parse_tts_config(_read_json(cfg_path), generation, file=str(cfg_path), generation_file=str(gen_path))
