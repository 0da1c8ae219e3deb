"""Yardstick for the publish benchmark: ``relay publish`` against a raw pipelined confirmed
publish (``bench/yardstick_publisher.py``) of the same messages to the same quorum queue.

Each side, in alternating order per pair (yardstick first in odd pairs, relay first in
even ones), gets a fresh database ``relay_bench_publish_*`` and broker namespace:

- relay: ``publish.one_run``, exactly as ``bench/publish.py`` runs it: N due webhook
  reminders loaded, then one ``relay publish`` (admission in batches, confirmed publish,
  rows marked ``queued``), timed from process start to exit;
- yardstick: the topology declared, then ``bench/yardstick_publisher.py`` in its own
  process (no database; ids 1..N), timed the same way.

Both must leave exactly N messages in the bulk lane queue (and the relay N rows
``queued``), else the run fails. Reported per side: wall time, messages/s, CPU per message
(the process's, from wait4), peak RSS; per pair relay/yardstick messages/s; the summary's
median and min-max over the pairs. Target (issue 30): relay >= 0.85x the yardstick.

    .venv/bin/python bench/yardstick_publish.py                       # 100,000, 3 pairs
    .venv/bin/python bench/yardstick_publish.py --count 2000 --pairs 1  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aio_pika
import publish
from _common import (
    AMQP_URL,
    CpuMonitor,
    bench_env,
    check,
    describe_groups,
    load_average,
    median,
    queue_depth,
    run_measured,
)

from service import amqp
from service.settings import Settings

HERE = Path(__file__).resolve().parent
TARGET_RATIO = 0.85


@dataclass
class Side:
    name: str
    count: int
    wall_seconds: float
    cpu_seconds: float
    peak_rss_mb: float

    @property
    def rate(self) -> float:
        return self.count / self.wall_seconds

    @property
    def cpu_us(self) -> float:
        return self.cpu_seconds / self.count * 1e6


async def yardstick_run(args: argparse.Namespace, number: int) -> Side:
    async with bench_env("publish", keep_scratch=args.keep_logs) as env:
        topology = amqp.Topology.from_settings(Settings(amqp_namespace=env.namespace))
        connection = await aio_pika.connect(AMQP_URL)
        try:
            await amqp.declare(await connection.channel(), topology)
        finally:
            await connection.close()
        command = [
            sys.executable,
            str(HERE / "yardstick_publisher.py"),
            *("--amqp-url", AMQP_URL, "--exchange", topology.work_exchange),
            *("--routing-key", amqp.BULK, "--count", str(args.count)),
            *("--max-in-flight", str(args.max_in_flight)),
        ]
        monitor = CpuMonitor().start()
        done = run_measured(command, env.env(), env.scratch, "yardstick", monitor)
        groups = monitor.stop()
        check(done, "yardstick publisher")
        depth = await queue_depth(env.namespace)
    side = Side(
        "yardstick", args.count, done.wall_seconds, done.cpu_seconds, done.max_rss_kb / 1024
    )
    print(
        f"yardstick {number}: {side.wall_seconds:6.2f} s = {side.rate:7.0f} messages/s, "
        f"CPU {side.cpu_us:4.0f} us/message, peak RSS {side.peak_rss_mb:5.1f} MB | "
        f"queue {depth} {'OK' if depth == args.count else 'MISMATCH'}\n"
        f"   CPU during the run, all processes: {describe_groups(groups, done.wall_seconds)}",
        flush=True,
    )
    if depth != args.count:
        raise SystemExit(f"yardstick: the lane queue holds {depth}, expected {args.count}")
    return side


async def relay_run(args: argparse.Namespace, number: int) -> Side:
    publish_args = argparse.Namespace(
        count=args.count,
        batch_size=0,
        max_in_flight=args.max_in_flight,
        profile="",
        cprofile="",
        ahead=0.0,  # due now, as the yardstick's messages are
        keep_logs=args.keep_logs,
    )
    run = await publish.one_run(publish_args, number)  # checks rows queued and queue depth
    return Side(
        "relay", run.published, run.publish_seconds, run.publish_cpu_seconds, run.publish_rss_mb
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--count", type=int, default=100_000, help="messages per side (100000)")
    parser.add_argument("--pairs", type=int, default=3, help="yardstick/relay pairs (3)")
    parser.add_argument(
        "--max-in-flight", type=int, default=1000, help="unconfirmed publishes, both (1000)"
    )
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    print(
        f"== publish yardstick: {args.count} messages per side, {args.pairs} pair(s); "
        f"load average {load_average()}",
        flush=True,
    )
    ratios: list[float] = []
    pairs: list[tuple[Side, Side]] = []
    for number in range(1, args.pairs + 1):
        order = (yardstick_run, relay_run) if number % 2 else (relay_run, yardstick_run)
        sides = {side.name: side for side in [await run(args, number) for run in order]}
        yard, relay = sides["yardstick"], sides["relay"]
        pairs.append((yard, relay))
        ratios.append(relay.rate / yard.rate)
        print(
            f"-- pair {number}: relay {relay.rate:.0f}/s ({relay.cpu_us:.0f} us CPU/message), "
            f"yardstick {yard.rate:.0f}/s ({yard.cpu_us:.0f} us): relay/yardstick "
            f"x{ratios[-1]:.2f}",
            flush=True,
        )
    ratio = median(ratios)
    print(
        f"summary over {len(ratios)} pair(s): relay/yardstick messages/s median x{ratio:.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}); target >= x{TARGET_RATIO}: "
        f"{'met' if ratio >= TARGET_RATIO else 'NOT MET'} | relay "
        f"{median([r.rate for _, r in pairs]):.0f}/s, "
        f"{median([r.cpu_us for _, r in pairs]):.0f} us CPU/message, peak RSS "
        f"{median([r.peak_rss_mb for _, r in pairs]):.1f} MB | yardstick "
        f"{median([y.rate for y, _ in pairs]):.0f}/s, "
        f"{median([y.cpu_us for y, _ in pairs]):.0f} us CPU/message, peak RSS "
        f"{median([y.peak_rss_mb for y, _ in pairs]):.1f} MB"
    )


if __name__ == "__main__":
    asyncio.run(main())
