"""The ``omniloop`` command: serve, speak, chat, check-profile, bench, trace.

Parsing only; each subcommand's work lives in its own module, imported lazily so ``--help`` and
``check-profile`` start fast and need no torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from omniloop.log import setup_logging

DEFAULT_PROFILE = "qwen3_tts"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a profile value, e.g. --set stages.talker.max_num_seqs=32 (repeatable)")
    p.add_argument("--platform", choices=["cpu", "cuda"], default=None,
                   help="which platforms: overlay of the profile to apply (default: cuda if available)")
    p.add_argument("--log-format", choices=["console", "json"], default=None)
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING, ERROR")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="DIR",
                   help="checkpoint directory in the released layout (default: the profile's model_dir, "
                        "else a tiny random-weight model built on the fly)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                   help="dummy = the checkpoint's shapes with random weights (benchmarks)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniloop", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="serve a profile over HTTP (OpenAI-compatible) and ZeroMQ")
    p.add_argument("profile", nargs="?", default=DEFAULT_PROFILE, help=f"profile name or file (default {DEFAULT_PROFILE})")
    _model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--zmq", default=None, metavar="ADDR", help="also serve the ZeroMQ client protocol, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--ref-audio-dir", action="append", default=[], metavar="DIR",
                   help="directory from which ref_audio may be given as a path (repeatable)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, how long in-flight requests may finish before they are aborted")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024, metavar="N",
                   help="largest accepted HTTP request body (413 beyond it)")
    _common(p)

    p = sub.add_parser("speak", help="synthesize one utterance to a WAV file (all stages in this process)")
    _model_args(p)
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: the profile's)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--text", required=True)
    p.add_argument("--task", choices=["custom_voice", "voice_design", "base"], default=None,
                   help="default: the checkpoint's type")
    p.add_argument("--speaker", default=None)
    p.add_argument("--language", default=None)
    p.add_argument("--instructions", default=None)
    p.add_argument("--ref-audio", default=None, metavar="FILE")
    p.add_argument("--ref-text", default=None)
    p.add_argument("--x-vector-only", action="store_true")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (talker and code predictor)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-frames", type=int, default=None)
    p.add_argument("--out", required=True, metavar="OUT.wav")
    p.add_argument("--wav-format", choices=["pcm16", "float"], default="pcm16")
    p.add_argument("--codes-out", default=None, metavar="CODES.npy",
                   help="also write the generated codes, int64 [frames, 16]")
    _common(p)

    p = sub.add_parser("chat", help="chat with a thinker model (Qwen3-Omni), text and audio out")
    _model_args(p)
    p.add_argument("--profile", default="qwen3_omni")
    p.add_argument("--text", required=True)
    p.add_argument("--out", default=None, metavar="OUT.wav")
    _common(p)

    p = sub.add_parser("check-profile", help="print the resolved profile (overlays and --set applied)")
    p.add_argument("profile")
    _common(p)

    p = sub.add_parser("bench", help="benchmark a profile in-process (concurrency sweep)")
    p.add_argument("profile", nargs="?", default=DEFAULT_PROFILE)
    _model_args(p)
    p.add_argument("--concurrency", default="1,8,64", help="comma-separated concurrent stream counts")
    p.add_argument("--num-requests", type=int, default=None, help="per concurrency level (default 2x concurrency)")
    p.add_argument("--text-words", type=int, default=40)
    p.add_argument("--max-frames", type=int, default=None)
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run each level N times; the output adds each level's median, min and max")
    p.add_argument("--out", default=None, metavar="FILE.json")
    _common(p)

    p = sub.add_parser("trace", help="record a Chrome/Perfetto trace of a short run (open it in ui.perfetto.dev)")
    p.add_argument("profile", nargs="?", default=DEFAULT_PROFILE)
    _model_args(p)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--text-words", type=int, default=20)
    p.add_argument("--max-frames", type=int, default=25)
    p.add_argument("--out", default="omniloop-trace.json")
    _common(p)
    return parser


def _run_check_profile(args: argparse.Namespace) -> int:
    from omniloop.profile import dump_profile, load_profile

    print(dump_profile(load_profile(args.profile, args.overrides, args.platform)), end="")
    return 0


def _lazy(module: str, func: str = "main") -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import importlib

        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            print(f"omniloop {args.command}: not available in this build ({module} is missing)", file=sys.stderr)
            return 2
        return getattr(mod, func)(args)

    return run


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": _lazy("omniloop.serve.serve_cmd"),
    "speak": _lazy("omniloop.serve.speak"),
    "chat": _lazy("omniloop.serve.chat_cli"),
    "check-profile": _run_check_profile,
    "bench": _lazy("omniloop.serve.bench"),
    "trace": _lazy("omniloop.serve.trace"),
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    from omniloop.profile import ProfileError

    try:
        return COMMANDS[args.command](args)
    except ProfileError as exc:
        print(f"omniloop {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
