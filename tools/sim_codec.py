"""The 64-stream benchmark simulated on CPU, to compare codec chunking policies before spending GPU time.

The real ``CodecScheduler`` runs on a simulated clock; the talker and the codec are cost models fitted to H200
measurements (benchmarks/talker-steps.md, codec-steps.md): a talker plan costs ``prefill_ms`` per admitted prompt
plus one frame step of GPU time, after ``admit_host_ms`` per admitted prompt of its loop thread's submit (one
thread: plans queue for it; the GPU starts a plan only once its submit is done), a codec step one graph replay per frame bucket of its rows (``a + b * rows + c * rows *
frames`` ms, rows and frames rounded up to the captured buckets). Both stages share one GPU by processor sharing
(each gets half while both have work: the H200 ran them at about their serial sum, benchmarks/pipeline.md).
Clients are the bench's: closed loop, ``--concurrency`` of them, ``--num-requests`` in all, each request
``--max-frames`` frames; playback starts at a request's first audio and any gap over 1 ms is an underrun.

    python tools/sim_codec.py                                  # the CUDA profile's codec settings
    python tools/sim_codec.py --set urgent_s=0.4 --set join_fraction=0.6

What it is for: the number of codec steps and replays a policy needs and what it does to first audio and
underruns, in seconds of simulated time. Its absolute audio-s/s is a model's, not a measurement.
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from omniloop.gpu.cuda_graphs import batch_buckets, pick
from omniloop.models.qwen3_tts.speech_stream import FRAME_BUCKETS
from omniloop.models.qwen3_tts.stage_codec import scheduler_config
from omniloop.profile import load_profile
from omniloop.scheduler.codec import CodecConfig, CodecScheduler
from omniloop.scheduler.policy import FRAME_S
from omniloop.transport.messages import Chunk, Finish

DT = 1e-4  # s, the simulation's tick


@dataclass
class Costs:
    frame_ms: float = 4.98  # talker decode frame at 64 rows (H200, 2ff1ee9 with the partial sums of 89804cf)
    prefill_ms: float = 1.27  # per admitted ~220-token prompt (an 18 x 218 plan: 27.9 ms incl. its frame)
    # the talker loop thread's submit time an admitted prompt, before the plan's GPU work can start (H200 trace,
    # 89804cf: a 35-prompt admission plan spent 10.4 ms in submit); one loop thread, so plans queue for it
    admit_host_ms: float = 0.3
    prompt_tokens: int = 220
    token_budget: int = 4096
    talker_seats: int = 64  # the talker's max_num_seqs
    replay_a: float = 1.83  # codec replay ms = a + b * rows + c * rows * frames (fit to 64/16 x 1/2/8, 33d1196)
    replay_b: float = 0.0271
    replay_c: float = 0.0179


@dataclass
class Req:
    rid: int
    arrival: float
    frames: int = 0  # frames the talker has produced (or planned)
    first_audio: float | None = None
    audio_s: float = 0.0  # played-out clock: audio received so far
    play_start: float = 0.0
    gap_s: float = 0.0
    done: float | None = None


def codec_cost(plan, costs: Costs, rows_buckets: tuple[int, ...]) -> tuple[float, int]:
    groups: dict[int, int] = {}
    for seq in plan.seqs:
        f = pick(FRAME_BUCKETS, max(1, seq.end - seq.start))
        groups[f] = groups.get(f, 0) + 1
    ms, replays = 0.0, 0
    for f, rows in groups.items():
        while rows:
            r = min(rows, rows_buckets[-1])
            rb = pick(rows_buckets, r)
            ms += costs.replay_a + costs.replay_b * rb + costs.replay_c * rb * f
            replays += 1
            rows -= r
    return ms, replays


def simulate(cfg: CodecConfig, costs: Costs, concurrency: int, num_requests: int, max_frames: int,
             in_flight: int = 2) -> dict:
    now = [0.0]
    sched = CodecScheduler(cfg, clock=lambda: now[0])
    rows_buckets = batch_buckets(cfg.max_num_seqs)
    # one GPU stream each: its steps in flight as [remaining ms, callback], run in order
    talker: deque[list] = deque()  # [remaining ms, callback, when its submit is done on the loop thread]
    host_free = [0.0]  # when the talker's loop thread is next free
    codec: deque[list] = deque()
    reqs: dict[int, Req] = {}
    waiting: deque[int] = deque()
    active: list[int] = []  # prefilled, still producing frames
    submitted = 0
    codec_steps = codec_replays = 0

    def submit_new() -> None:
        nonlocal submitted
        if submitted < num_requests:
            reqs[submitted] = Req(submitted, now[0])
            waiting.append(submitted)
            submitted += 1

    for _ in range(concurrency):
        submit_new()

    def on_talker(rows: list[int], finals: set[int]) -> None:
        for rid in rows:
            final = rid in finals  # decided when the plan was made: a later plan in flight has counted on
            code = np.zeros((1, cfg.num_codebooks), dtype=np.int64)
            sched.extend(str(rid), Chunk(req_id=str(rid), seq=0, final=final, reason="length" if final else None,
                                         stage="talker"), {"codes": code})

    def plan_talker() -> None:
        news, tokens = [], 0
        while waiting and len(active) + len(news) < costs.talker_seats and tokens + costs.prompt_tokens <= costs.token_budget:
            news.append(waiting.popleft())
            tokens += costs.prompt_tokens
        rows = active + news
        if not rows:
            return
        for rid in rows:
            reqs[rid].frames += 1
        active[:] = [rid for rid in rows if reqs[rid].frames < max_frames]
        finals = {rid for rid in rows if reqs[rid].frames >= max_frames}
        ms = costs.prefill_ms * len(news) + costs.frame_ms
        host_free[0] = max(now[0], host_free[0]) + costs.admit_host_ms * len(news) / 1e3
        talker.append([ms, lambda rows=list(rows), finals=finals: on_talker(rows, finals), host_free[0]])

    def on_codec(plan) -> None:
        for seq in plan.seqs:  # the step's PCM reaches every client at once, when the step ends
            req = reqs[int(seq.req_id)]
            if req.first_audio is None:
                req.first_audio = req.play_start = now[0]
            elif now[0] > req.play_start + req.audio_s:  # the player ran dry: it waits, then plays on
                req.gap_s += now[0] - (req.play_start + req.audio_s)
                req.play_start = now[0] - req.audio_s
            req.audio_s += (seq.end - seq.start) * FRAME_S
        for emit in sched.update(plan, [np.zeros(0, np.float32)] * len(plan.seqs)):
            if isinstance(emit.msg, Finish):
                reqs[int(emit.msg.req_id)].done = now[0]
                submit_new()

    while any(r.done is None for r in reqs.values()):
        while len(talker) < in_flight and (active or waiting):
            plan_talker()
        while len(codec) < in_flight:
            plan = sched.schedule()
            if plan is None:
                break
            ms, replays = codec_cost(plan, costs, rows_buckets)
            codec_steps += 1
            codec_replays += replays
            codec.append([ms, lambda plan=plan: on_codec(plan)])
        talker_runs = bool(talker) and talker[0][2] <= now[0]  # still being submitted: the GPU has none of it
        share = 0.5 if talker_runs and codec else 1.0
        now[0] += DT
        for stream in (talker, codec):
            if stream and (stream is codec or talker_runs):
                stream[0][0] -= DT * 1e3 * share
                if stream[0][0] <= 0:
                    stream.popleft()[1]()
        if now[0] > 60:
            raise RuntimeError("simulation did not finish in 60 s")
    done = list(reqs.values())
    wall = max(r.done for r in done)
    first = np.array([r.first_audio - r.arrival for r in done])
    return dict(audio_s_per_s=round(sum(r.audio_s for r in done) / wall, 1), wall_s=round(wall, 3),
                audio_s=round(sum(r.audio_s for r in done), 6), num_finished=len(done),
                first_audio_p95_s=round(float(np.percentile(first, 95)), 4),
                underrun_fraction=float(np.mean([r.gap_s > 1e-3 for r in done])),
                gap_mean_s=round(float(np.mean([r.gap_s for r in done])), 4),
                codec_steps=codec_steps, codec_replays=codec_replays)


def profile_codec_config(name: str) -> CodecConfig:
    """The codec scheduler's settings as ``name``'s CUDA overlay gives them to the stage."""
    profile = load_profile(name, platform="cuda")
    return scheduler_config(next(s for s in profile.stages if s.name == "codec"), profile.chunking)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--max-frames", type=int, default=100)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a CodecConfig field (urgent_s, join_fraction, initial_frames, frames) or a Costs field")
    ap.add_argument("--profile", default="qwen3_tts", help="whose CUDA codec stage and chunking to start from")
    args = ap.parse_args()
    cfg = profile_codec_config(args.profile)
    costs = Costs()
    for item in args.set:
        key, value = item.split("=", 1)
        if hasattr(cfg, key):
            cfg = replace(cfg, **{key: type(getattr(cfg, key))(value)})
        else:
            costs = replace(costs, **{key: type(getattr(costs, key))(value)})
    out = simulate(cfg, costs, args.concurrency, args.num_requests, args.max_frames)
    print(json.dumps(dict(settings=args.set, **out)))


if __name__ == "__main__":
    main()
