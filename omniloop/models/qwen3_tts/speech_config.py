"""Configs of the Qwen3-TTS 12 Hz speech tokenizer (Mimi encoder + codec decoder) and the speaker encoder.

Parsed once from the released JSON (``speech_tokenizer/config.json``, ``speaker_encoder_config`` in the main
``config.json``) into frozen dataclasses. Missing optional fields take the released defaults; fields the
model cannot run without raise ``ValueError`` naming the file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
NUM_CODE_GROUPS = 16


def _take(cls: type, raw: dict[str, Any], where: str, renames: dict[str, str] | None = None) -> Any:
    """Build ``cls`` from the keys of ``raw`` it declares; a field without a default must be present."""
    raw = dict(raw)
    for old, new in (renames or {}).items():
        if old in raw and new not in raw:
            raw[new] = raw.pop(old)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in raw and raw[f.name] is not None:
            value = raw[f.name]
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{where}: missing or bad field ({e})") from None


@dataclass(frozen=True)
class DecoderConfig:
    latent_dim: int
    codebook_dim: int
    hidden_size: int = 1024
    codebook_size: int = 2048
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_quantizers: int = NUM_CODE_GROUPS
    num_semantic_quantizers: int = 1
    sliding_window: int = 72
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    attention_bias: bool = False
    hidden_act: str = "silu"
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"decoder_config.hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.sliding_window < 1:
            raise ValueError(f"decoder_config.sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_semantic_quantizers != 1:
            raise ValueError("decoder_config.num_semantic_quantizers must be 1 (split RVQ: 1 semantic + acoustic)")

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)


@dataclass(frozen=True)
class EncoderConfig:
    """The Mimi encoder half (SEANet convs, transformer, downsample, split RVQ)."""

    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    compress: int = 2
    use_causal_conv: bool = True
    use_conv_shortcut: bool = False
    pad_mode: str = "constant"
    audio_channels: int = 1
    sampling_rate: int = SAMPLE_RATE
    frame_rate: float = 12.5
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None
    intermediate_size: int = 2048
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    codebook_size: int = 2048
    codebook_dim: int = 256
    vector_quantization_hidden_dimension: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1

    def __post_init__(self) -> None:
        if not self.use_causal_conv:
            raise ValueError("encoder_config.use_causal_conv must be true (Qwen3-TTS uses the causal Mimi encoder)")
        if self.use_conv_shortcut:
            raise ValueError("encoder_config.use_conv_shortcut=true is not supported")
        if self.pad_mode not in ("constant", "replicate"):
            raise ValueError(f"encoder_config.pad_mode {self.pad_mode!r} is not supported")
        if self.hidden_act != "gelu":
            raise ValueError(f"encoder_config.hidden_act {self.hidden_act!r} is not supported (only 'gelu')")
        if self.audio_channels != 1:
            raise ValueError(f"encoder_config.audio_channels must be 1, got {self.audio_channels}")

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def encodec_frame_rate(self) -> int:
        return math.ceil(self.sampling_rate / math.prod(self.upsampling_ratios))


@dataclass(frozen=True)
class SpeechTokenizerConfig:
    decoder: DecoderConfig
    encoder: EncoderConfig
    encoder_valid_num_quantizers: int = NUM_CODE_GROUPS
    input_sample_rate: int = SAMPLE_RATE
    output_sample_rate: int = SAMPLE_RATE
    decode_upsample_rate: int = SAMPLES_PER_FRAME
    encode_downsample_rate: int = SAMPLES_PER_FRAME

    def __post_init__(self) -> None:
        if self.decoder.samples_per_frame != self.decode_upsample_rate:
            raise ValueError(f"decoder upsampling gives {self.decoder.samples_per_frame} samples per frame but "
                             f"decode_upsample_rate is {self.decode_upsample_rate}")
        if self.encoder_valid_num_quantizers != self.decoder.num_quantizers:
            raise ValueError(f"encoder_valid_num_quantizers {self.encoder_valid_num_quantizers} != "
                             f"decoder_config.num_quantizers {self.decoder.num_quantizers}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "speech_tokenizer/config.json") -> SpeechTokenizerConfig:
        model_type = raw.get("model_type")
        if model_type not in (None, "qwen3_tts_tokenizer_12hz"):
            raise ValueError(f"{where}: model_type {model_type!r} is not 'qwen3_tts_tokenizer_12hz'")
        for key in ("decoder_config", "encoder_config"):
            if not isinstance(raw.get(key), dict):
                raise ValueError(f"{where}: field {key!r} is missing or not an object")
        decoder = _take(DecoderConfig, raw["decoder_config"], f"{where} decoder_config")
        # transformers saves MimiConfig.frame_rate under its private attribute name.
        encoder = _take(EncoderConfig, raw["encoder_config"], f"{where} encoder_config", {"_frame_rate": "frame_rate"})
        top = {k: raw[k] for k in ("encoder_valid_num_quantizers", "input_sample_rate", "output_sample_rate",
                                   "decode_upsample_rate", "encode_downsample_rate") if k in raw}
        return cls(decoder=decoder, encoder=encoder, **top)

    @classmethod
    def from_dir(cls, speech_dir: str | Path) -> SpeechTokenizerConfig:
        path = Path(speech_dir) / "config.json"
        return cls.from_dict(read_json(path), str(path))


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """ECAPA-TDNN x-vector extractor; ``enc_dim`` equals the talker hidden size."""

    enc_dim: int = 1024
    mel_dim: int = 128
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = SAMPLE_RATE

    def __post_init__(self) -> None:
        if not len(self.enc_channels) == len(self.enc_kernel_sizes) == len(self.enc_dilations):
            raise ValueError("speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations differ in length")
        if len(self.enc_channels) < 3:
            raise ValueError("speaker_encoder_config.enc_channels needs at least 3 entries")
        if self.sample_rate != SAMPLE_RATE:
            raise ValueError(f"speaker_encoder_config.sample_rate must be {SAMPLE_RATE}, got {self.sample_rate}")

    @classmethod
    def from_model_config(cls, raw: dict[str, Any], where: str = "config.json") -> SpeakerEncoderConfig:
        sub = raw.get("speaker_encoder_config")
        if not isinstance(sub, dict):
            raise ValueError(f"{where}: field 'speaker_encoder_config' is missing or not an object")
        return _take(cls, sub, f"{where} speaker_encoder_config")


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:  # no permission, not UTF-8 text
        raise ValueError(f"{path} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data
