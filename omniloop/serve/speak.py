"""``omniloop speak``: one utterance to a WAV file, every stage as a thread of this process."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import numpy as np

from omniloop.profile import Profile, load_profile
from omniloop.transport.messages import Sampling, SpeechRequest

SAMPLE_RATE = 24000


def speak_profile(args: argparse.Namespace) -> Profile:
    """The profile with every stage in this process (threads over inproc sockets)."""
    base = load_profile(args.profile, list(args.overrides), args.platform)
    overrides = list(args.overrides) + ["transport=inproc"]
    for stage in base.stages:
        overrides.append(f"stages.{stage.name}.placement=thread")
        if args.device:
            overrides.append(f"stages.{stage.name}.device={args.device}")
        if args.dtype:
            overrides.append(f"stages.{stage.name}.dtype={args.dtype}")
    if args.model:
        overrides.append(f"model_dir={args.model}")
    if args.load_format:
        overrides.append(f"load_format={args.load_format}")
    return load_profile(args.profile, overrides, args.platform)


def request_from_args(args: argparse.Namespace) -> SpeechRequest:
    ref_audio = None
    if args.ref_audio:
        path = Path(args.ref_audio)
        if not path.is_file():
            raise SystemExit(f"omniloop speak: --ref-audio {path}: no such file")
        ref_audio = path.read_bytes()
    greedy = args.greedy
    sampling = Sampling(
        do_sample=False if greedy else None,
        sub_do_sample=False if greedy else None,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    return SpeechRequest(
        text=args.text,
        task=args.task,
        speaker=args.speaker,
        language=args.language,
        instructions=args.instructions,
        ref_audio=ref_audio,
        ref_text=args.ref_text,
        x_vector_only=args.x_vector_only,
        sampling=sampling,
        max_frames=args.max_frames,
        return_codes=bool(args.codes_out),
    )


async def synthesize(profile: Profile, request: SpeechRequest) -> tuple[np.ndarray, np.ndarray, object]:
    """Run one request through a freshly started engine; returns (pcm, codes, finish)."""
    from omniloop.actors.engine import Engine

    engine = await Engine.start(profile)
    try:
        engine.validate(request)
        pcm: list[np.ndarray] = []
        codes: list[np.ndarray] = []
        finish = None
        async for out in engine.generate(request):
            if out.pcm is not None:
                pcm.append(out.pcm)
            if getattr(out, "codes", None) is not None:
                codes.append(out.codes)
            finish = out.finish or finish
    finally:
        await engine.shutdown(timeout_s=5.0)
    audio = np.concatenate(pcm) if pcm else np.zeros(0, np.float32)
    all_codes = np.concatenate(codes) if codes else np.zeros((0, 16), np.int64)
    return audio, all_codes, finish


def main(args: argparse.Namespace) -> int:
    import soundfile as sf

    from omniloop.errors import RequestError

    profile = speak_profile(args)
    try:
        pcm, codes, finish = asyncio.run(synthesize(profile, request_from_args(args)))
    except RequestError as exc:
        print(f"omniloop speak: {exc.message}", file=sys.stderr)
        return 2
    if finish is None or finish.reason not in ("stop", "length"):
        reason = getattr(finish, "reason", "no finish")
        print(f"omniloop speak: request failed ({reason}): {getattr(finish, 'error', '')}", file=sys.stderr)
        return 1
    subtype = "PCM_16" if args.wav_format == "pcm16" else "FLOAT"
    sf.write(args.out, pcm, SAMPLE_RATE, subtype=subtype, format="WAV")
    if args.codes_out:
        np.save(args.codes_out, codes.astype(np.int64))
    print(f"wrote {args.out}: {len(pcm) / SAMPLE_RATE:.2f} s, {len(codes) if args.codes_out else len(pcm) // 1920} "
          f"frames, finish={finish.reason}", file=sys.stderr)
    return 0
