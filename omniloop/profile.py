"""Deploy profiles: YAML parsed once, at the edge, into frozen typed structures.

A profile names the stages of a pipeline (which registry model each runs, where, with what capacity),
the edges between them, chunking and sampling defaults. Loading order:

1. ``base: other.yaml`` (optional) is loaded first and this file is deep-merged over it;
2. the ``platforms:`` overlay for the chosen platform (``cpu`` / ``cuda``) is merged over that;
3. ``--set key.path=value`` overrides are merged last;
4. the result is validated: unknown keys and wrong types are errors naming the key and the file.

Stage entries are a list in YAML; overlays and overrides address a stage by its name
(``stages.talker.max_num_seqs=32``).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import msgspec
import yaml

from omniloop.transport.messages import Sampling

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
PLACEMENTS = ("process", "thread")
TRANSPORTS = ("auto", "inproc", "ipc", "tcp")  # auto: inproc where both ends share the frontend's process, else ipc
DTYPES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file and the key."""


class StageConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    model: str
    placement: str = "process"
    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = 64
    max_num_tokens: int = 8192
    max_in_flight: int = 2
    gpu_memory_fraction: float | None = None
    options: dict[str, Any] = {}


class Chunking(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    initial_frames: int = 2  # first codec chunk, frames (small: first audio leaves early)
    frames: int = 25  # later codec chunks, frames
    max_codec_frames: int | None = None  # hard limit; reaching it ends the request with codec_limit
    urgent_s: float = 0.4  # a client with less audio buffered gets whatever frames there are, not a full chunk
    join_fraction: float = 0.5  # a stream with this much of its chunk joins a codec step that goes anyway


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    stages: tuple[StageConfig, ...]
    edges: tuple[tuple[str, str], ...] = ()
    model_dir: str | None = None
    load_format: str = "auto"
    transport: str = "ipc"
    chunking: Chunking = Chunking()
    sampling: Sampling = Sampling()
    seed: int = 0
    startup_timeout_s: float = 600.0
    max_pending: int = 256
    max_text_chars: int = 4096
    source: str = ""  # the file it came from (set by load_profile)

    def stage(self, name: str) -> StageConfig:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"profile {self.name!r} has no stage {name!r} (stages: {self.stage_names})")

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    @property
    def first_stage(self) -> StageConfig:
        """The stage no edge points into: where requests enter."""
        targets = {dst for _, dst in self.edges}
        return next(s for s in self.stages if s.name not in targets)

    @property
    def last_stage(self) -> StageConfig:
        sources = {src for src, _ in self.edges}
        return next(s for s in self.stages if s.name not in sources)

    def next_of(self, name: str) -> str | None:
        """The downstream stage of ``name``, or None for the last stage (whose next is the frontend)."""
        return next((dst for src, dst in self.edges if src == name), None)

    def ordered_stages(self) -> list[StageConfig]:
        """Stages from first to last along the edges."""
        order, name = [], self.first_stage.name
        while name is not None:
            order.append(self.stage(name))
            name = self.next_of(name)
        return order


def resolve_profile_path(path_or_name: str) -> Path:
    """A path to a YAML file, or the name of one in the bundled profiles/ directory."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    bundled = PROFILES_DIR / f"{path_or_name}.yaml"
    if bundled.is_file():
        return bundled
    known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")) if PROFILES_DIR.is_dir() else []
    raise ProfileError(f"profile {path_or_name!r} not found: not a file, and not one of {known}")


def load_profile(
    path_or_name: str, overrides: list[str] | tuple[str, ...] = (), platform: str | None = None
) -> Profile:
    """Load, overlay, override and validate a profile. ``platform`` None = detect (cuda if available)."""
    path = resolve_profile_path(path_or_name)
    raw = _load_with_base(path, seen=())
    platforms = raw.pop("platforms", None) or {}
    if not isinstance(platforms, dict):
        raise ProfileError(f"{path}: 'platforms' must be a mapping of platform name -> overlay")
    platform = platform or detect_platform()
    if platform in platforms:
        raw = _merge(raw, platforms[platform], f"{path}: platforms.{platform}")
    for item in overrides:
        raw = _merge(raw, _parse_override(item), f"--set {item}")
    raw.setdefault("source", str(path))
    return _validate(raw, path)


def detect_platform() -> str:
    forced = os.environ.get("OMNILOOP_PLATFORM")
    if forced:
        return forced
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def dump_profile(profile: Profile) -> str:
    """The resolved profile as YAML (what ``omniloop check-profile`` prints)."""
    return yaml.safe_dump(msgspec.to_builtins(profile), sort_keys=False)


def _load_with_base(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if path.resolve() in seen:
        raise ProfileError(f"{path}: 'base' chain loops back to itself")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: a profile must be a YAML mapping")
    base = raw.pop("base", None)
    if base is None:
        return raw
    base_path = (path.parent / base) if not Path(base).is_absolute() else Path(base)
    if not base_path.is_file():
        raise ProfileError(f"{path}: base {base!r} not found (looked at {base_path})")
    return _merge(_load_with_base(base_path, seen + (path.resolve(),)), raw, str(path))


def _merge(base: dict[str, Any], over: dict[str, Any], where: str) -> dict[str, Any]:
    """Deep-merge ``over`` into a copy of ``base``; ``stages`` in an overlay is keyed by stage name."""
    if not isinstance(over, dict):
        raise ProfileError(f"{where}: an overlay must be a mapping")
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key == "stages" and isinstance(value, dict):
            out["stages"] = _merge_stages(out.get("stages") or [], value, where)
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and key != "options":
            out[key] = _merge(out[key], value, f"{where}: {key}")
        elif key == "options" and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_stages(stages: list[dict[str, Any]], over: dict[str, Any], where: str) -> list[dict[str, Any]]:
    by_name = {s.get("name"): i for i, s in enumerate(stages) if isinstance(s, dict)}
    out = list(stages)
    for name, patch in over.items():
        if name not in by_name:
            raise ProfileError(f"{where}: no stage named {name!r} (stages: {list(by_name)})")
        out[by_name[name]] = _merge(out[by_name[name]], patch, f"{where}: stages.{name}")
    return out


def _parse_override(item: str) -> dict[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ProfileError(f"--set {item!r}: expected key.path=value")
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError as exc:
        raise ProfileError(f"--set {item!r}: the value is not valid YAML: {exc}") from None
    for part in reversed(key.split(".")):
        if not part:
            raise ProfileError(f"--set {item!r}: empty key segment")
        value = {part: value}
    return value


def _validate(raw: dict[str, Any], path: Path) -> Profile:
    try:
        profile = msgspec.convert(raw, type=Profile)
    except msgspec.ValidationError as exc:
        raise ProfileError(f"{path}: {_readable(exc, raw)}") from None
    _check_semantics(profile, path)
    return profile


def _readable(exc: msgspec.ValidationError, raw: dict[str, Any]) -> str:
    """msgspec says `$.stages[1]`; name the stage too, since that is what the user wrote."""
    text = str(exc)
    stages = raw.get("stages") or []
    for i, stage in enumerate(stages):
        token = f"$.stages[{i}]"
        if token in text and isinstance(stage, dict) and "name" in stage:
            text = text.replace(token, f"{token} (stage {stage['name']!r})")
    return text


def _check_semantics(p: Profile, path: Path) -> None:
    def fail(msg: str) -> None:
        raise ProfileError(f"{path}: {msg}")

    if not p.stages:
        fail("'stages' is empty")
    names = p.stage_names
    if len(set(names)) != len(names):
        fail(f"stage names must be unique, got {names}")
    for s in p.stages:
        where = f"stages.{s.name}"
        if s.placement not in PLACEMENTS:
            fail(f"{where}.placement must be one of {PLACEMENTS}, got {s.placement!r}")
        if s.dtype not in DTYPES:
            fail(f"{where}.dtype must be one of {DTYPES}, got {s.dtype!r}")
        if not (s.device == "cpu" or s.device == "cuda" or s.device.startswith("cuda:")):
            fail(f"{where}.device must be cpu, cuda or cuda:N, got {s.device!r}")
        for field in ("max_num_seqs", "max_num_tokens", "max_in_flight"):
            if getattr(s, field) < 1:
                fail(f"{where}.{field} must be >= 1, got {getattr(s, field)}")
        if s.gpu_memory_fraction is not None and not 0.0 < s.gpu_memory_fraction <= 1.0:
            fail(f"{where}.gpu_memory_fraction must be in (0, 1], got {s.gpu_memory_fraction}")
    shares: dict[str, list[tuple[str, float]]] = {}
    for s in p.stages:
        if s.gpu_memory_fraction is not None and s.device != "cpu":
            device = "cuda:0" if s.device == "cuda" else s.device
            shares.setdefault(device, []).append((s.name, s.gpu_memory_fraction))
    for device, parts in shares.items():
        if sum(f for _, f in parts) > 1.0 + 1e-9:
            fail(f"stages on {device} ask for more than the whole device: "
                 + " + ".join(f"{name} {f}" for name, f in parts) + f" = {sum(f for _, f in parts):.2f} > 1")
    for src, dst in p.edges:
        for end in (src, dst):
            if end not in names:
                fail(f"edge [{src}, {dst}] names unknown stage {end!r} (stages: {names})")
    if len({src for src, _ in p.edges}) != len(p.edges) or len({d for _, d in p.edges}) != len(p.edges):
        fail("edges must form one chain (each stage has at most one next and one previous stage)")
    if len(p.stages) > 1 and len(p.edges) != len(p.stages) - 1:
        fail(f"{len(p.stages)} stages need {len(p.stages) - 1} edges forming a chain, got {len(p.edges)}")
    if len(p.ordered_stages()) != len(p.stages):
        fail("edges do not connect every stage in one chain")
    if p.transport not in TRANSPORTS:
        fail(f"transport must be one of {TRANSPORTS}, got {p.transport!r}")
    if p.transport == "inproc" and any(s.placement == "process" for s in p.stages):
        fail("transport inproc needs every stage placed as a thread")
    if p.load_format not in LOAD_FORMATS:
        fail(f"load_format must be one of {LOAD_FORMATS}, got {p.load_format!r}")
    c = p.chunking
    if c.initial_frames < 1 or c.frames < 1:
        fail("chunking.initial_frames and chunking.frames must be >= 1")
    if c.max_codec_frames is not None and c.max_codec_frames < 1:
        fail("chunking.max_codec_frames must be >= 1 when set")
    if not c.urgent_s >= 0:
        fail(f"chunking.urgent_s must be >= 0 seconds, got {c.urgent_s}")
    if not 0 < c.join_fraction <= 1:
        fail(f"chunking.join_fraction must be in (0, 1], got {c.join_fraction}")
    if p.max_pending < 1 or p.max_text_chars < 1:
        fail("max_pending and max_text_chars must be >= 1")
