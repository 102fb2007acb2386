"""Weights for the talker stage: the released safetensors layout, or deterministic dummy weights.

Released keys (``talker.model.layers.N...``, ``talker.code_predictor.model...``) are renamed onto
``Qwen3TtsModel``; ``speaker_encoder.*`` tensors are returned untouched for the speaker encoder. Every
expected tensor must be present with the expected shape, and no unknown key may remain.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from omniloop.models.qwen3_tts.config import ConfigError, TtsConfig, _read_json, load_tts_config
from omniloop.models.qwen3_tts.talker import Qwen3TtsModel

# released prefix -> ours; the first match wins, so longer prefixes come first
_RENAMES = (
    ("talker.code_predictor.model.codec_embedding.", "code_predictor.codec_embedding."),
    ("talker.code_predictor.model.", "code_predictor.model."),
    ("talker.code_predictor.", "code_predictor."),
    ("talker.model.codec_embedding.", "talker.codec_embedding."),
    ("talker.model.text_embedding.", "talker.text_embedding."),
    ("talker.", "talker."),
)
SPEAKER_PREFIX = "speaker_encoder."


def released_to_ours(key: str) -> str | None:
    for old, new in _RENAMES:
        if key.startswith(old):
            return new + key[len(old):]
    return None


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise ConfigError(f"{index}: weight_map is missing or not a map of tensor name -> file name")
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = [model_dir / "model.safetensors"]
    for f in files:
        if not f.exists():
            raise ConfigError(f"{f}: weight file not found")
    return files


def load_tts_weights(model_dir: str | Path, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """-> (state dict in ``Qwen3TtsModel`` names, speaker-encoder tensors with the prefix stripped)."""
    model_dir = Path(model_dir)
    state: dict[str, torch.Tensor] = {}
    speaker: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for f in _shard_files(model_dir):
        try:
            fh = safe_open(str(f), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:  # truncated/corrupt header: name the file
            raise ConfigError(f"{f}: not a readable safetensors file ({e})") from None
        with fh:
            for key in fh.keys():
                if key.startswith(SPEAKER_PREFIX):
                    speaker[key[len(SPEAKER_PREFIX):]] = fh.get_tensor(key).to(device)
                    continue
                ours = released_to_ours(key)
                if ours is None:
                    unknown.append(key)
                    continue
                tensor = fh.get_tensor(key)
                state[ours] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
    if unknown:
        raise ConfigError(f"{model_dir}: unexpected weight keys {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    return state, speaker


def check_state(model: Qwen3TtsModel, state: dict[str, torch.Tensor], source: str) -> None:
    expected = model.state_dict()
    for key, ref in expected.items():
        if key not in state:
            raise ConfigError(f"{source}: missing weight {key!r} (expected shape {list(ref.shape)})")
        if tuple(state[key].shape) != tuple(ref.shape):
            raise ConfigError(f"{source}: weight {key!r} has shape {list(state[key].shape)}, "
                              f"expected {list(ref.shape)}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ConfigError(f"{source}: weights {extra[:5]} do not belong to this config")


def _dummy_tensor(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    noise = torch.randn(shape, generator=g)
    if len(shape) == 1:
        return noise * 0.02 if name.endswith("bias") else 1.0 + 0.1 * noise
    if "embedding" in name:
        return noise
    return noise * (1.0 / math.sqrt(shape[-1]))  # fan-in scaled keeps activations O(1)


def init_dummy_(model: Qwen3TtsModel, seed: int = 0) -> None:
    """Deterministic random weights: each tensor depends only on (seed, its name)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_dummy_tensor(name, p.shape, seed).to(p.dtype))


def build_model(model_dir: str | Path | None = None, *, cfg: TtsConfig | None = None, load_format: str = "auto",
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0) -> tuple[Qwen3TtsModel, dict[str, torch.Tensor]]:
    """Build the talker-stage model. ``load_format``: "auto" reads safetensors, "dummy" needs only the
    config (``cfg`` or ``model_dir/config.json``). On the meta device nothing is initialized.
    Returns (model, speaker-encoder tensors; empty for dummy)."""
    if cfg is None:
        if model_dir is None:
            raise ConfigError("build_model: need model_dir or cfg")
        cfg = load_tts_config(model_dir)
    if load_format not in ("auto", "dummy"):
        raise ConfigError(f"load_format {load_format!r} must be 'auto' or 'dummy'")
    model = Qwen3TtsModel(cfg, device=device, dtype=dtype).eval()
    speaker: dict[str, torch.Tensor] = {}
    if torch.device(device).type == "meta":
        return model, speaker
    if load_format == "dummy":
        init_dummy_(model, seed)
    else:
        if model_dir is None:
            raise ConfigError("build_model: load_format 'auto' needs model_dir")
        state, speaker = load_tts_weights(model_dir, device, dtype)
        check_state(model, state, str(model_dir))
        model.load_state_dict(state, strict=True)
    return model, speaker
