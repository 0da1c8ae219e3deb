"""Summarise a py-spy ``--format raw`` profile (collapsed stacks): the functions with the
most samples, inclusive (anywhere on the stack) and self (top of the stack).

    .venv/bin/python bench/pyspy_top.py /tmp/drain.1.txt [--top 30] [--match consumer/]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")


def frame_name(frame: str) -> str:
    match = _FRAME.match(frame)
    if not match:
        return frame
    path = match["file"]
    for marker in ("site-packages/", "/lib/python3.11/", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{match['func']} ({path})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--match", default="", help="only frames whose text contains this")
    args = parser.parse_args()
    inclusive: Counter[str] = Counter()
    self_: Counter[str] = Counter()
    total = 0
    with open(args.path) as f:
        for line in f:
            stack, _, count_text = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            count = int(count_text)
            frames = [frame_name(fr) for fr in stack.split(";")]
            if frames and frames[0].startswith("process "):
                frames = frames[1:]
            if frames and frames[0].startswith("thread "):
                frames = frames[1:]
            total += count
            if frames:
                self_[frames[-1]] += count
            for name in set(frames):
                inclusive[name] += count
    print(f"{total} samples")
    for title, counter in (("inclusive", inclusive), ("self", self_)):
        print(f"-- top {args.top} {title}")
        shown = 0
        for name, n in counter.most_common():
            if args.match and args.match not in name:
                continue
            print(f"{100 * n / total:5.1f}%  {name}")
            shown += 1
            if shown >= args.top:
                break


if __name__ == "__main__":
    main()
