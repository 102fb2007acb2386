"""``omniloop bench``: drive the engine in-process at several concurrency levels and report throughput,
first-audio latency, end-to-end latency and playback underruns.

Each stream is a client that starts playing at its first audio and plays in real time: an *underrun* is
any moment its player runs dry before the request finished; *gap* is the total time it spent dry. With
random weights the talker rarely stops, so every request is capped at ``--max-frames`` (the number of
frames each request produces then is known, and the audio seconds are counted, not assumed).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from omniloop.profile import Profile
from omniloop.serve.serve_cmd import profile_from_args
from omniloop.transport.messages import SpeechRequest

SAMPLE_RATE = 24000
WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls sing softly about rain and "
         "distant mountains under a pale blue sky").split()


@dataclass
class StreamResult:
    first_audio_s: float
    end_s: float
    audio_s: float
    gap_s: float
    reason: str

    @property
    def is_served(self) -> bool:
        """Ended normally (a stop or the length limit): its latencies count."""
        return self.reason in ("stop", "length")


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    wall_s: float
    audio_s_per_s: float
    first_audio_mean_s: float
    first_audio_p95_s: float
    # the requests each client sent first (all at once when the level starts: a cold burst of ``concurrency``)
    first_audio_p95_first_wave_s: float
    end_to_end_mean_s: float
    end_to_end_p95_s: float
    rtf_mean: float  # request wall time / its audio duration
    underrun_fraction: float  # requests whose player ran dry at least once (>1 ms)
    gap_mean_s: float
    errors: int


def _text(num_words: int, i: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(num_words)).capitalize() + "."


async def _one(engine, request: SpeechRequest) -> StreamResult:
    start = time.perf_counter()
    first = None
    played = 0.0  # audio seconds received so far
    stall = 0.0
    reason = "error"
    async for out in engine.generate(request):
        now = time.perf_counter()
        if out.pcm is not None and len(out.pcm):
            if first is None:
                first = now
            else:
                dry_at = first + stall + played  # when the player runs out of what it has
                if now > dry_at:
                    stall += now - dry_at
            played += len(out.pcm) / SAMPLE_RATE
        if out.finish is not None:
            reason = out.finish.reason
    end = time.perf_counter()
    return StreamResult(first_audio_s=(first or end) - start, end_s=end - start, audio_s=played, gap_s=stall,
                        reason=reason)


async def _level(engine, concurrency: int, num_requests: int, num_words: int, max_frames: int,
                 speaker: str | None) -> LevelResult:
    queue = list(range(num_requests))
    results: list[StreamResult] = []
    first_wave: list[StreamResult] = []

    async def client() -> None:
        is_first = True
        while queue:
            i = queue.pop()
            req = SpeechRequest(text=_text(num_words, i), speaker=speaker, max_frames=max_frames)
            results.append(await _one(engine, req))
            if is_first:
                first_wave.append(results[-1])
                is_first = False

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.is_served]
    first = np.array([r.first_audio_s for r in ok]) if ok else np.zeros(1)
    first_ok = [r.first_audio_s for r in first_wave if r.is_served] or [0.0]
    e2e = np.array([r.end_s for r in ok]) if ok else np.zeros(1)
    return LevelResult(
        concurrency=concurrency, num_requests=num_requests, wall_s=wall,
        audio_s_per_s=sum(r.audio_s for r in ok) / wall,
        first_audio_mean_s=float(first.mean()), first_audio_p95_s=float(np.percentile(first, 95)),
        first_audio_p95_first_wave_s=float(np.percentile(first_ok, 95)),
        end_to_end_mean_s=float(e2e.mean()), end_to_end_p95_s=float(np.percentile(e2e, 95)),
        rtf_mean=float(np.mean([r.end_s / max(r.audio_s, 1e-9) for r in ok])) if ok else 0.0,
        underrun_fraction=float(np.mean([r.gap_s > 1e-3 for r in ok])) if ok else 0.0,
        gap_mean_s=float(np.mean([r.gap_s for r in ok])) if ok else 0.0,
        errors=len(results) - len(ok),
    )


async def run_bench(profile: Profile, levels: list[int], num_requests: int | None, num_words: int,
                    max_frames: int, repeat: int = 1) -> dict:
    """Each level ``repeat`` times on one engine (a level's run is a few seconds: single runs of one tree have
    differed by ~10 % in throughput and by tens of points in the underrun fraction)."""
    from omniloop.actors.engine import Engine

    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    engine = await Engine.start(profile)
    try:
        speaker = engine.info.speakers[0] if engine.info.speakers else None
        await _level(engine, 1, 2, num_words, max_frames, speaker)  # warm-up: first-use allocations, caches
        out, spread = [], []
        for c in levels:
            runs = []
            for k in range(repeat):
                result = await _level(engine, c, num_requests or 2 * c, num_words, max_frames, speaker)
                runs.append({**asdict(result), "run": k, "gpu": gpu_state()})
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
            out += runs
            if repeat > 1:
                spread.append(summarize_runs(runs))
        stats = await engine.refresh_stats()
    finally:
        await engine.shutdown(timeout_s=10)
    result = {"levels": out, "stage_stats": {k: _plain(v) for k, v in stats.items()}}
    if spread:
        result["summary"] = spread
    return result


GPU_FIELDS = {"index": "index", "clocks.sm": "sm_mhz", "clocks.mem": "mem_mhz", "power.draw": "power_w",
              "temperature.gpu": "temp_c", "clocks_throttle_reasons.active": "clock_limits"}


def gpu_state() -> list[dict] | None:
    """Each GPU's SM and memory clocks (MHz), power (W), temperature (C) and active clock-limit reasons (a hex
    bit mask, nvidia-smi's ``clocks_event_reasons``) now, from nvidia-smi; None where it is missing or fails.
    Sampled after each run: runs of one tree in calls an hour apart have differed by ~7 %, and this tells a
    throttled GPU from a slower tree."""
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    gpus = []
    for line in proc.stdout.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(GPU_FIELDS):
            return None
        gpu: dict = {}
        for key, value in zip(GPU_FIELDS.values(), values):
            try:
                gpu[key] = value if key == "clock_limits" else int(value) if key == "index" else float(value)
            except ValueError:  # "[N/A]" and the like
                gpu[key] = None
        gpus.append(gpu)
    return gpus or None


def summarize_runs(runs: list[dict]) -> dict:
    """Median, min and max of every metric over the runs of one level that completed any request (a run whose
    every request failed has no latencies: its zeros would pass for perfect ones), and the errors of all."""
    metrics = [k for k, v in runs[0].items() if isinstance(v, float)]
    served = [r for r in runs if r["errors"] < r["num_requests"]]
    out: dict = {"concurrency": runs[0]["concurrency"], "runs": len(runs), "runs_with_errors":
                 sum(r["errors"] > 0 for r in runs), "errors": sum(r["errors"] for r in runs)}
    for key in metrics if served else ():
        values = np.array([r[key] for r in served])
        out[key] = {"median": float(np.median(values)), "min": float(values.min()), "max": float(values.max())}
    return out


def _plain(value: object) -> object:
    import msgspec

    try:
        return msgspec.to_builtins(value)
    except TypeError:
        return str(value)


def tree_digest(root: str | Path) -> str:
    """A short sha256 of the code that ran: every ``omniloop/**/*.py`` and ``profiles/*.yaml`` under ``root`` (paths
    and bytes). Unlike the commit it cannot be stale on a copy of the tree; to match one, run this on a checkout
    (``git archive <sha> omniloop profiles | tar -x -C DIR``)."""
    root = Path(root)
    h = hashlib.sha256()
    for path in sorted([*root.glob("omniloop/**/*.py"), *root.glob("profiles/*.yaml")]):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _provenance(args: argparse.Namespace) -> dict:
    def git(*cmd: str) -> str:
        try:
            proc = subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return "unknown"
        return proc.stdout.strip() if proc.returncode == 0 else "unknown"

    device = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            device = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    # a copy of the tree without .git (e.g. on a lent GPU machine) cannot tell; OMNILOOP_COMMIT can
    commit = os.environ.get("OMNILOOP_COMMIT") or git("rev-parse", "HEAD")
    return {"command": " ".join(sys.argv), "commit": commit, "tree": tree_digest(Path(__file__).parents[2]),
            "dirty": None if (status := git("status", "--porcelain", "--untracked-files=no")) == "unknown" else bool(status),
            "device": device, "host": platform.node(), "python": platform.python_version()}


def main(args: argparse.Namespace) -> int:
    profile = profile_from_args(args)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    import uvloop

    result = uvloop.run(run_bench(profile, levels, args.num_requests, args.text_words, args.max_frames or 100,
                                  repeat=args.repeat))
    result["provenance"] = _provenance(args)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
