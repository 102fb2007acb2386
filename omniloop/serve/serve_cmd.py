"""``omniloop serve``: resolve the profile from the command line, then hand over to the server."""

from __future__ import annotations

import argparse

from omniloop.profile import Profile, load_profile


def profile_from_args(args: argparse.Namespace) -> Profile:
    """The profile named on the command line (serve, bench, trace) with --model / --load-format folded in
    as overrides (they win over --set)."""
    overrides = list(args.overrides)
    if getattr(args, "model", None):
        overrides.append(f"model_dir={args.model}")
    if getattr(args, "load_format", None):
        overrides.append(f"load_format={args.load_format}")
    return load_profile(args.profile, overrides, args.platform)


def main(args: argparse.Namespace) -> int:
    from omniloop.serve.server import run_server

    return run_server(
        profile_from_args(args),
        host=args.host,
        port=args.port,
        zmq_addr=args.zmq,
        api_key=args.api_key,
        ref_audio_dirs=args.ref_audio_dir,
        shutdown_timeout_s=args.shutdown_timeout,
        max_body_bytes=args.max_body_bytes,
    )
