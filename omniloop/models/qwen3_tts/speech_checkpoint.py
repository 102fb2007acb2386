"""Weights for the speech tokenizer and speaker encoder: safetensors (single file or sharded index) into
our modules, with errors that name the file and the key; and a deterministic dummy init for benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn


def find_weights(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: ``model.safetensors`` or the shards its index names."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
        shards = sorted({folder / name for name in weight_map.values()})
        for shard in shards:
            if not shard.is_file():
                raise FileNotFoundError(f"{index} names shard {shard.name}, which does not exist")
        return shards
    raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")


def read_prefixed(files: list[Path], prefix: str) -> dict[str, Tensor]:
    """Every tensor whose key starts with ``prefix``, with the prefix removed."""
    out: dict[str, Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key.startswith(prefix):
                        out[key[len(prefix):]] = f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"{path}: cannot read safetensors ({e})") from None
    return out


def load_module(module: nn.Module, tensors: dict[str, Tensor], where: str, prefix: str = "",
                ignore: tuple[str, ...] = ()) -> None:
    """Copy ``tensors`` into ``module`` (persistent parameters and buffers), strictly.

    ``ignore`` lists checkpoint key suffixes that are present on disk but unused here."""
    own = module.state_dict()
    tensors = {k: v for k, v in tensors.items() if not k.endswith(ignore)}
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    if missing:
        raise KeyError(f"{where}: missing keys {[prefix + k for k in missing[:8]]}"
                       f"{f' (+{len(missing) - 8} more)' if len(missing) > 8 else ''}")
    if unexpected:
        raise KeyError(f"{where}: unexpected keys {[prefix + k for k in unexpected[:8]]}"
                       f"{f' (+{len(unexpected) - 8} more)' if len(unexpected) > 8 else ''}")
    for key, value in tensors.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise ValueError(f"{where}: key {prefix + key} has shape {list(value.shape)}, "
                             f"the config expects {list(own[key].shape)}")
    with torch.no_grad():
        for key, target in own.items():
            target.copy_(tensors[key].to(target.dtype))


def dummy_init_(module: nn.Module, seed: int = 0) -> None:
    """Deterministic, well-scaled random weights (fan-in normal; norms near 1; small biases), so dummy
    benchmarks run on realistic values without NaN or saturation."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.state_dict().items()):
            if not p.is_floating_point():
                continue
            noise = torch.randn(p.shape, generator=gen)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("cluster_usage",):
                value = 1.0 + noise.abs()
            elif leaf in ("embedding_sum", "embed_sum"):
                value = noise
            elif leaf in ("alpha", "beta", "bias"):
                value = noise * 0.02
            elif leaf in ("scale", "gamma"):
                value = 0.01 + noise.abs() * 0.001
            elif p.ndim == 1:
                value = 1.0 + noise * 0.02
            else:
                value = noise * p[0].numel() ** -0.5
            p.copy_(value.to(p.dtype))
