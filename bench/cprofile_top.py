"""Print a cProfile stats file: the functions with the most self time and cumulative time.

.venv/bin/python bench/cprofile_top.py /tmp/consume.prof [--top 40]
"""

from __future__ import annotations

import argparse
import pstats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    stats = pstats.Stats(args.path)
    stats.strip_dirs()
    for key in ("tottime", "cumulative"):
        print(f"==== by {key}")
        stats.sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
