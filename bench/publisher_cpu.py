"""The relay's publisher alone: its own CPU per delivery message, for now and into the
timer ladder.

In this process, no database: ``ConfirmedPublisher.publish_many`` (what ``relay publish``
calls per batch) sends N messages in batches of 500 with confirms, either due now (to the
lane) or due over 10 s from ``--ahead`` seconds on (into the ladder, ``service/timer.py``),
and the process's CPU time is divided by N. Only this process's CPU is counted, so the
figure moves little with what the broker and the rest of the machine are doing: for an A/B
of the publish path, run it from two trees in turn (``PYTHONPATH`` picks the code).

    .venv/bin/python bench/publisher_cpu.py                 # 20,000 due now, then ahead
    .venv/bin/python bench/publisher_cpu.py --runs 3 --count 50000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import uvloop
from _common import AMQP_URL
from yardstick_publisher import TRACE_HEADER  # the relay's trace header, as published

from service import amqp, publishing
from service.settings import Settings

BATCH = 500


async def one_run(count: int, ahead: float) -> tuple[float, float]:
    """(CPU µs per message, messages/s) for ``count`` publishes ``ahead`` s from due."""
    settings = Settings(amqp_url=AMQP_URL, amqp_namespace=f"bench-{uuid.uuid4().hex[:8]}")
    connection, publisher = await publishing.open_publisher(
        settings, "bench", announce_alarms=False
    )
    try:
        items = [(i, False, ahead + 10.0 * i / count if ahead else 0.0) for i in range(count)]
        cpu, wall = time.process_time(), time.monotonic()
        for start in range(0, count, BATCH):
            _, failed = await publisher.publish_many(items[start : start + BATCH], TRACE_HEADER)
            if failed:
                raise SystemExit(f"{len(failed)} publishes not confirmed")
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        channel = await connection.channel()
        await amqp.delete_topology(channel, amqp.Topology.from_settings(settings))
        await connection.close()
    return cpu / count * 1e6, count / wall


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--ahead", type=float, default=30.0, help="the ladder's waits start here (s)"
    )
    args = parser.parse_args()
    for run in range(1, args.runs + 1):
        for ahead in (0.0, args.ahead):
            per_message, rate = await one_run(args.count, ahead)
            where = (
                "due now (lane)" if not ahead else f"due in {ahead:.0f}-{ahead + 10:.0f} s (ladder)"
            )
            print(
                f"run {run}, {where}: {per_message:6.1f} µs CPU a message, {rate:7.0f} messages/s",
                flush=True,
            )


if __name__ == "__main__":
    uvloop.install()
    asyncio.run(main())
