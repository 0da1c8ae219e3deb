"""Run one ``relay`` command under cProfile with a CPU-time clock and save the stats.

CPU time (``time.process_time``), not wall time: on a busy 2-core machine a sampling
profiler mostly sees a process that is runnable but not running (e.g. preempted right
after a loopback ``send`` woke its peer). The profiler roughly doubles the CPU cost, so
use it for where the time goes, never for throughput.

    .venv/bin/python bench/cprofile_relay.py /tmp/consume.prof consume
    .venv/bin/python bench/cprofile_top.py /tmp/consume.prof
"""

from __future__ import annotations

import cProfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.ops import cli


def main() -> int:
    out, *argv = sys.argv[1:]
    profile = cProfile.Profile(time.process_time)
    profile.enable()
    try:
        return cli.main(argv)
    finally:
        profile.disable()
        profile.dump_stats(out)


if __name__ == "__main__":
    sys.exit(main())
