"""The embedded default: a tiny Qwen3-TTS checkpoint *layout* (configs + tokenizer, no weights).

``omniloop serve`` with no ``--model`` loads this directory with ``load_format: dummy``, so a new user
gets a server that answers at once on any CPU. The weights are random: the audio is noise, and the
server says so at start-up. Everything else — prompt building, the talker/code-predictor loop,
streaming codec, the APIs — is the real code path.

The configs follow the released layout (config.json with talker_config / code_predictor_config /
speaker_encoder_config, generation_config.json, tokenizer.json, speech_tokenizer/config.json) so the
same loaders read it. Real codec ids are kept; the text vocabulary is a byte-level BPE of our own in
which "assistant", "user", "system" and "\\n" are single tokens, as the prompt templates need.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

TINY_VERSION = 1
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>")
# the Qwen2 pre-tokenizer split pattern
_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_CODEC_IDS = {
    "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_think_id": 2154,
    "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
}
_LANGUAGES = {"english": 2050, "german": 2053, "spanish": 2054, "chinese": 2055, "japanese": 2058,
              "french": 2061, "sichuan_dialect": 2062, "korean": 2064}
_SPEAKERS = {"ryan": 3061, "vivian": 3065, "eric": 2875}
_DIALECT = {"ryan": False, "vivian": False, "eric": "sichuan_dialect"}


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable mapping of the 256 byte values (what ByteLevel pre-tokenization emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes)}


def build_tokenizer() -> Tokenizer:
    b2u = _byte_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    for word in ("assistant", "user", "system"):
        cur = b2u[ord(word[0])]
        for ch in word[1:]:
            merges.append((cur, b2u[ord(ch)]))
            cur += b2u[ord(ch)]
            vocab.setdefault(cur, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok


# Talker / code-predictor / codec sizes. "tiny" answers at once on any CPU; "1.7b" and "0.6b" are the released
# shapes (REFERENCE.md section 4) for benchmarks with random weights.
SIZES: dict[str, dict] = {
    "tiny": dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16, mrope=[4, 2, 2],
                 text_hidden=32, text_vocab=None, cp_hidden=32, cp_inter=64, cp_layers=2, cp_heads=4, cp_kv=2,
                 cp_head_dim=8, spk_channels=[32, 32, 32, 32, 96], spk_attn=16, spk_se=16, max_new_tokens=75,
                 dec=dict(hidden_size=32, latent_dim=64, codebook_dim=32, head_dim=16, num_attention_heads=2,
                          num_key_value_heads=2, intermediate_size=64, num_hidden_layers=1, decoder_dim=64,
                          vector_quantization_hidden_dimension=32),
                 enc=dict(hidden_size=32, num_filters=4, num_hidden_layers=1, intermediate_size=64,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=16, codebook_dim=16,
                          vector_quantization_hidden_dimension=16, upsample_groups=32)),
    "1.7b": dict(hidden=2048, inter=6144, layers=28, heads=16, kv_heads=8, head_dim=128, mrope=[24, 20, 20],
                 text_hidden=2048, text_vocab=151936, cp_hidden=1024, cp_inter=3072, cp_layers=5, cp_heads=16,
                 cp_kv=8, cp_head_dim=128, spk_channels=[512, 512, 512, 512, 1536], spk_attn=128, spk_se=128,
                 max_new_tokens=8192,
                 dec=dict(hidden_size=512, latent_dim=1024, codebook_dim=512, head_dim=64, num_attention_heads=16,
                          num_key_value_heads=16, intermediate_size=1024, num_hidden_layers=8, decoder_dim=1536,
                          vector_quantization_hidden_dimension=512),
                 enc=dict(hidden_size=512, num_filters=64, num_hidden_layers=8, intermediate_size=2048,
                          num_attention_heads=8, num_key_value_heads=8, head_dim=64, codebook_dim=256,
                          vector_quantization_hidden_dimension=256, upsample_groups=512)),
}
SIZES["0.6b"] = dict(SIZES["1.7b"], hidden=1024, inter=3072, cp_hidden=1024)


def _configs(tok: Tokenizer, variant: str, size: str = "tiny") -> dict[str, dict]:
    ids = tok.token_to_id
    z = SIZES[size]
    hidden, heads, kv_heads, cp_hidden = z["hidden"], z["heads"], z["kv_heads"], z["cp_hidden"]
    talker = {
        "model_type": "qwen3_tts_talker", "vocab_size": 3072, "hidden_size": hidden,
        "intermediate_size": z["inter"], "num_hidden_layers": z["layers"], "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": z["head_dim"], "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": {"interleaved": True, "mrope_section": z["mrope"], "rope_type": "default"},
        "num_code_groups": 16, "text_hidden_size": z["text_hidden"],
        "text_vocab_size": z["text_vocab"] or tok.get_vocab_size(),
        "position_id_per_seconds": 13, "codec_language_id": dict(_LANGUAGES),
        "spk_id": dict(_SPEAKERS) if variant == "custom_voice" else {},
        "spk_is_dialect": dict(_DIALECT) if variant == "custom_voice" else {},
        "code_predictor_config": {
            "vocab_size": 2048, "hidden_size": cp_hidden, "intermediate_size": z["cp_inter"],
            "num_hidden_layers": z["cp_layers"], "num_attention_heads": z["cp_heads"],
            "num_key_value_heads": z["cp_kv"], "head_dim": z["cp_head_dim"], "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "rope_scaling": None, "num_code_groups": 16,
        },
        **_CODEC_IDS,
    }
    config = {
        "architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
        "tts_model_type": variant, "tts_model_size": {"0.6b": "0b6", "1.7b": "1b7"}.get(size, size), "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "im_start_token_id": ids("<|im_start|>"), "im_end_token_id": ids("<|im_end|>"),
        "tts_pad_token_id": ids("<tts_pad>"), "tts_bos_token_id": ids("<tts_text_bos>"),
        "tts_eos_token_id": ids("<tts_text_eod>"), "assistant_token_id": ids("assistant"),
        "talker_config": talker,
        "speaker_encoder_config": {
            "mel_dim": 128, "enc_dim": hidden, "enc_channels": z["spk_channels"],
            "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": z["spk_attn"], "enc_res2net_scale": 8, "enc_se_channels": z["spk_se"],
            "sample_rate": 24000,
        },
        "omniloop_note": f"{size} layout built by omniloop for random weights; not a trained model",
    }
    generation = {
        "do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
        "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
        "subtalker_temperature": 0.9, "max_new_tokens": z["max_new_tokens"],  # random weights rarely stop
    }
    speech = {
        "model_type": "qwen3_tts_tokenizer_12hz", "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000, "output_sample_rate": 24000,
        "decode_upsample_rate": 1920, "encode_downsample_rate": 1920,
        "encoder_config": {**{
            "sampling_rate": 24000, "frame_rate": 12.5, "audio_channels": 1, "hidden_size": 32,
            "num_filters": 4, "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7,
            "last_kernel_size": 3, "residual_kernel_size": 3, "dilation_growth_rate": 2,
            "use_causal_conv": True, "pad_mode": "constant", "compress": 2, "trim_right_ratio": 1.0,
            "codebook_size": 2048, "codebook_dim": 16, "num_quantizers": 32, "use_conv_shortcut": False,
            "vector_quantization_hidden_dimension": 16, "num_semantic_quantizers": 1, "upsample_groups": 32,
            "num_hidden_layers": 1, "intermediate_size": 64, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "gelu", "max_position_embeddings": 8000,
            "norm_eps": 1e-5, "use_cache": False, "rope_theta": 10000.0, "sliding_window": 250,
            "layer_scale_initial_scale": 0.01,
        }, **z["enc"]},
        "decoder_config": {**{
            "codebook_size": 2048, "codebook_dim": 32, "hidden_size": 32, "latent_dim": 64, "head_dim": 16,
            "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_quantizers": 16, "num_semantic_quantizers": 1,
            "semantic_codebook_size": 4096, "vector_quantization_hidden_dimension": 32,
            "sliding_window": 72, "max_position_embeddings": 8000, "rope_theta": 10000, "hidden_act": "silu",
            "layer_scale_initial_scale": 0.01, "rms_norm_eps": 1e-5, "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2], "decoder_dim": 64,
        }, **z["dec"]},
    }
    preprocessor = {
        "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "sampling_rate": 24000,
        "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
        "chunk_length_s": None, "overlap": None,
    }
    return {"config.json": config, "generation_config.json": generation,
            "speech_tokenizer/config.json": speech, "speech_tokenizer/preprocessor_config.json": preprocessor}


def default_cache_dir() -> Path:
    return Path(os.environ.get("OMNILOOP_CACHE", Path.home() / ".cache" / "omniloop"))


@functools.cache
def _layout(variant: str, size: str) -> tuple[str, dict[str, dict], Tokenizer]:
    """The layout's directory name (content-addressed), files and tokenizer, built once per process: a
    builtin profile resolves its checkpoint on every request's validation, which must cost a stat, not a
    tokenizer build (~1.2 ms of GIL per request on the H200's frontend thread)."""
    tok = build_tokenizer()
    files = _configs(tok, variant, size)
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode() + tok.to_str().encode()).hexdigest()[:12]
    return f"{size}-qwen3-tts-{variant}-v{TINY_VERSION}-{digest}", files, tok


def ensure_tiny_checkpoint(variant: str = "custom_voice", cache_dir: Path | None = None,
                           size: str = "tiny") -> Path:
    """Write (once) and return the layout (configs + tokenizer, no weights) for ``variant`` (base |
    custom_voice | voice_design) at ``size`` (tiny | 0.6b | 1.7b); load it with ``load_format: dummy``."""
    if variant not in ("base", "custom_voice", "voice_design"):
        raise ValueError(f"variant must be base, custom_voice or voice_design, got {variant!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    name, files, tok = _layout(variant, size)
    out = (cache_dir or default_cache_dir()) / name
    if (out / "tokenizer.json").is_file():
        return out
    # Unique per call: two threads of one process (thread-placed stages) must not share a temp dir.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    (tmp / "speech_tokenizer").mkdir()
    for name, content in files.items():
        (tmp / name).write_text(json.dumps(content, indent=2))
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "unk_token": None,
    }, indent=2))
    try:
        os.replace(tmp, out)
    except OSError as exc:  # another thread or process won the race: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "tokenizer.json").is_file():
            raise OSError(f"cannot create the tiny checkpoint layout at {out}: {exc}") from exc
    return out
