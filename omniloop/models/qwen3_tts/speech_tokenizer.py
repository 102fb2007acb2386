"""The speech tokenizer as one object: config + decoder (+ optional encoder), loaded from a checkpoint.

``model_dir`` may be the model folder (with ``speech_tokenizer/`` inside, the released layout) or the
``speech_tokenizer/`` folder itself. ``load_format="dummy"`` builds the same shapes from the config alone
with deterministic random weights (benchmarks without the weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from omniloop.models.qwen3_tts.speech_checkpoint import dummy_init_, find_weights, load_module, read_prefixed
from omniloop.models.qwen3_tts.speech_config import SpeechTokenizerConfig, read_json
from omniloop.models.qwen3_tts.speech_decoder import SpeechDecoder
from omniloop.models.qwen3_tts.speech_encoder import SpeechEncoder


def speech_dir_of(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if (path / "speech_tokenizer" / "config.json").is_file():
        return path / "speech_tokenizer"
    if (path / "config.json").is_file() and read_json(path / "config.json").get("model_type") == \
            "qwen3_tts_tokenizer_12hz":
        return path
    raise FileNotFoundError(f"{path} has no speech_tokenizer/config.json (and is not a speech tokenizer folder)")


def check_preprocessor(speech_dir: Path, sample_rate: int) -> None:
    """The encoder expects raw mono PCM at the model rate (EncodecFeatureExtractor, feature_size 1)."""
    path = speech_dir / "preprocessor_config.json"
    if not path.is_file():
        return
    raw = read_json(path)
    if raw.get("feature_size", 1) != 1:
        raise ValueError(f"{path}: feature_size {raw['feature_size']} is not 1 (mono)")
    if raw.get("sampling_rate", sample_rate) != sample_rate:
        raise ValueError(f"{path}: sampling_rate {raw['sampling_rate']} != encoder input rate {sample_rate}")


@dataclass
class SpeechTokenizer:
    config: SpeechTokenizerConfig
    decoder: SpeechDecoder
    encoder: SpeechEncoder | None

    @classmethod
    def load(cls, model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             load_format: str = "auto", with_encoder: bool = True, seed: int = 0,
             channels_last: bool | None = None) -> SpeechTokenizer:
        speech_dir = speech_dir_of(model_dir)
        cfg = SpeechTokenizerConfig.from_dir(speech_dir)
        check_preprocessor(speech_dir, cfg.input_sample_rate)
        return cls.build(cfg, device, dtype, load_format, with_encoder, seed, speech_dir, channels_last)

    @classmethod
    def build(cls, cfg: SpeechTokenizerConfig, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, load_format: str = "dummy", with_encoder: bool = True,
              seed: int = 0, speech_dir: Path | None = None, channels_last: bool | None = None) -> SpeechTokenizer:
        """``channels_last``: the decoder's conv layout (``SpeechDecoder.set_channels_last``); None = on for
        CUDA (cuDNN's NHWC kernels, no layout transposes), off elsewhere (the reference's layout, bit-exact).
        On CUDA run it with ``torch.backends.cudnn.benchmark``: cuDNN's heuristic NHWC choice for the 384-channel
        k7 d9 conv took 344 ms in a microbenchmark (benchmarks/codec-steps.md)."""
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
        decoder = SpeechDecoder(cfg.decoder)
        encoder = SpeechEncoder(cfg.encoder, cfg.encoder_valid_num_quantizers, cfg.encode_downsample_rate) \
            if with_encoder else None
        if load_format == "dummy":
            dummy_init_(decoder, seed)
            if encoder is not None:
                dummy_init_(encoder, seed + 1)
        else:
            if speech_dir is None:
                raise ValueError("load_format 'auto' needs the speech tokenizer folder")
            files = find_weights(speech_dir)
            where = str(files[0]) if len(files) == 1 else str(speech_dir)
            load_module(decoder, read_prefixed(files, "decoder."), where, "decoder.")
            if encoder is not None:
                # Mimi's codebook 'initialized' flags are training bookkeeping, unused at inference.
                load_module(encoder, read_prefixed(files, "encoder."), where, "encoder.")
        decoder.refresh()  # codebook tables from float32 weights, then cast with the rest
        decoder.to(device=device, dtype=dtype).eval()
        decoder.set_channels_last(torch.device(device).type == "cuda" if channels_last is None else channels_last)
        if encoder is not None:
            # The encoder runs once per reference clip; float32 keeps its nearest-codebook picks exact.
            encoder.to(device=device, dtype=torch.float32).eval()
        return cls(cfg, decoder, encoder)
