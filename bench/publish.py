"""Publish benchmark: N due reminders -> one ``relay publish`` process.

Per run (fresh database ``relay_bench_publish_*`` and broker namespace ``bench-*``):
write N one-shot webhook reminders due now, time ``relay reminders load``, then time one
``relay publish`` (admission + confirmed publish + mark queued) and read its peak RSS and
CPU from the kernel (wait4). Checks that every row ended ``queued`` and that the lane
queue holds N messages.

    .venv/bin/python bench/publish.py                  # 100,000 reminders, 1 run
    .venv/bin/python bench/publish.py --count 10000 --runs 3
    .venv/bin/python bench/publish.py --ahead 40   # due 30-70 s on: into the timer ladder

Targets (issue): >= 5,000 reminders/s created and confirmed; peak RSS < 150 MB, flat
between 10k and 100k; loading 100k reminders well under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import asyncpg
from _common import (
    RELAY,
    CpuMonitor,
    MachineLoad,
    bench_env,
    check,
    describe_groups,
    load_average,
    median,
    queue_depth,
    run_measured,
    state_counts,
    write_reminders,
)

TARGET_RATE = 5000.0
TARGET_RSS_MB = 150.0


@dataclass
class PublishRun:
    load_seconds: float
    load_rss_mb: float
    publish_seconds: float
    publish_rss_mb: float
    publish_cpu_seconds: float
    machine_busy: float
    cpu_groups: dict[str, float]
    published: int

    @property
    def rate(self) -> float:
        return self.published / self.publish_seconds


async def one_run(args: argparse.Namespace, number: int) -> PublishRun:
    async with bench_env("publish", keep_scratch=args.keep_logs) as env:
        extra = {}
        if args.batch_size:
            extra["publish_batch_size"] = str(args.batch_size)
        if args.max_in_flight:
            extra["publish_max_in_flight"] = str(args.max_in_flight)
        relay_env = env.env(**extra)
        path = env.scratch / "reminders.jsonl"
        write_reminders(path, args.count, "http://127.0.0.1:9/hooks/bench", args.ahead)
        loaded = run_measured(
            [*RELAY, "reminders", "load", str(path)], relay_env, env.scratch, "load"
        )
        check(loaded, "relay reminders load")

        cmd = [*RELAY, "publish"]
        if args.profile:
            py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            out = f"{args.profile}.{number}.txt"
            cmd = [
                py_spy,
                "record",
                "--nonblocking",
                "-r",
                "200",
                "-f",
                "raw",
                "-o",
                out,
                "--",
                *cmd,
            ]
        if args.cprofile:
            wrapper = str(Path(__file__).resolve().parent / "cprofile_relay.py")
            cmd = [sys.executable, wrapper, f"{args.cprofile}.{number}.prof", "publish"]
        load = MachineLoad()
        monitor = CpuMonitor().start()
        published = run_measured(cmd, relay_env, env.scratch, "publish", monitor)
        busy = load.stop()
        groups = monitor.stop()
        check(published, "relay publish")
        match = re.search(r"published=(\d+)", published.stdout)
        count = int(match.group(1)) if match else 0

        pool = await asyncpg.create_pool(env.database_url, min_size=1, max_size=1)
        try:
            states = await state_counts(pool)
        finally:
            await pool.close()
        depth = await queue_depth(env.namespace)
        # Ahead of their due time, the messages wait in the ladder, not in the lane.
        landed = count if args.ahead else depth
        ok = states.get("queued", 0) == args.count and landed == args.count == count
        run = PublishRun(
            load_seconds=loaded.wall_seconds,
            load_rss_mb=loaded.max_rss_kb / 1024,
            publish_seconds=published.wall_seconds,
            publish_rss_mb=published.max_rss_kb / 1024,
            publish_cpu_seconds=published.cpu_seconds,
            machine_busy=busy,
            cpu_groups=groups,
            published=count,
        )
        print(
            f"run {number}: load {run.load_seconds:6.2f} s (peak RSS {run.load_rss_mb:5.1f} MB) | "
            f"publish {run.publish_seconds:6.2f} s = {run.rate:7.0f} reminders/s, "
            f"peak RSS {run.publish_rss_mb:5.1f} MB, CPU {run.publish_cpu_seconds:5.2f} s "
            f"({run.publish_cpu_seconds / max(count, 1) * 1e6:4.0f} us/reminder), "
            f"machine busy {busy:4.0%} | {published.stdout.strip()} | "
            f"ledger {states} queue {depth} {'OK' if ok else 'MISMATCH'}\n"
            f"   CPU during the publish run, all processes: "
            f"{describe_groups(groups, published.wall_seconds)}\n"
            f"   publish process runnable (R: running or waiting for a CPU, not for I/O) in "
            f"{monitor.running_share('publish'):.0%} of 20 ms samples",
            flush=True,
        )
        if not ok:
            raise SystemExit("publish benchmark: not every reminder was published and queued")
        return run


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=100_000, help="due reminders (100000)")
    parser.add_argument("--runs", type=int, default=1, help="repeat with fresh state; median")
    parser.add_argument("--batch-size", type=int, default=0, help="RELAY_PUBLISH_BATCH_SIZE")
    parser.add_argument("--max-in-flight", type=int, default=0, help="RELAY_PUBLISH_MAX_IN_FLIGHT")
    parser.add_argument(
        "--profile", default="", help="py-spy raw profile prefix (perturbs the figures)"
    )
    parser.add_argument(
        "--cprofile", default="", help="run publish under cProfile (CPU clock); prefix"
    )
    parser.add_argument(
        "--ahead",
        type=float,
        default=0.0,
        help="reminders due over this many seconds from 30 s on, within the look-ahead: "
        "published into the timer ladder (at most 40)",
    )
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    if not 0 <= args.ahead <= 40:
        parser.error("--ahead: 0 to 40 s (the load takes ~10 s; the look-ahead is 75 s)")
    print(
        f"== publish benchmark: {args.count} due reminders, {args.runs} run(s); "
        f"load average {load_average()}",
        flush=True,
    )
    runs = [await one_run(args, n + 1) for n in range(args.runs)]
    rate = median([r.rate for r in runs])
    rss = median([r.publish_rss_mb for r in runs])
    load_s = median([r.load_seconds for r in runs])
    cpu_us = median([r.publish_cpu_seconds / r.published * 1e6 for r in runs])
    print(
        f"median of {len(runs)}: publish {rate:.0f} reminders/s "
        f"(target >= {TARGET_RATE:.0f}: {'met' if rate >= TARGET_RATE else 'MISSED'}), "
        f"peak RSS {rss:.1f} MB (target < {TARGET_RSS_MB:.0f}: "
        f"{'met' if rss < TARGET_RSS_MB else 'MISSED'}), CPU {cpu_us:.0f} us/reminder; "
        f"reminders load {load_s:.2f} s "
        f"({args.count / load_s:.0f}/s, peak RSS {median([r.load_rss_mb for r in runs]):.1f} MB)"
    )


if __name__ == "__main__":
    asyncio.run(main())
