"""Where each thread held the GIL: a summary of ``py-spy record --gil --threads --format raw`` output.

    py-spy record --gil --threads --rate 1000 --nonblocking --format raw -o gil.raw -- \\
        python3 -m omniloop bench qwen3_tts --model builtin:1.7b --concurrency 64 --max-frames 100
    python tools/gil_profile.py gil.raw --thread talker --within _on_step_done _launch _on_inbox

(py-spy is not a dependency: install its wheel where you profile.) Each line of the raw file is a stack,
root first, and a sample count. For every thread whose name contains ``--thread`` this prints the samples
that pass ``--within`` (stacks containing any of those function names: e.g. the stage loop's callbacks,
to leave start-up out), then the functions by inclusive share and by self share.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter


def parse(lines: list[str]) -> list[tuple[str, list[str], int]]:
    """(thread, function names root first, samples) per stack line."""
    out = []
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        names = [re.sub(r" \(.*$", "", f) for f in frames[1:]]
        out.append((frames[0], names, int(count)))
    return out


def summarize(stacks: list[tuple[str, list[str], int]], thread: str, within: list[str],
              top: int) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    inclusive: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    total = 0
    for name, names, count in stacks:
        if thread not in name or (within and not any(w in n for n in names for w in within)):
            continue
        total += count
        for fn in set(names):
            inclusive[fn] += count
        if names:
            leaf[names[-1]] += count
    return total, inclusive.most_common(top), leaf.most_common(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", help="py-spy --format raw output")
    parser.add_argument("--thread", action="append", default=[], help="thread name substring (repeatable)")
    parser.add_argument("--within", nargs="*", default=[], help="keep stacks containing one of these functions")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.raw) as f:
        stacks = parse(f.readlines())
    threads = args.thread or sorted({name for name, _, _ in stacks})
    for thread in threads:
        total, inclusive, leaf = summarize(stacks, thread, args.within, args.top)
        print(f"== {thread}: {total} samples")
        for fn, n in inclusive:
            print(f"{n:7d} {100 * n / max(total, 1):5.1f}%  {fn}")
        print("-- self")
        for fn, n in leaf:
            print(f"{n:7d} {100 * n / max(total, 1):5.1f}%  {fn}")


if __name__ == "__main__":
    main()
