"""Timer benchmark: how late is a delivery admitted ahead by runs in shuffled order?

Per run (fresh database and broker namespace, one ``relay consume``, the lean receiver):

1. N one-shot reminders (default 3,000) due at random over one minute that starts after a
   lead for admitting them, split at random into R groups (default 5): every group spans
   the whole minute;
2. each group loaded, then admitted ahead by its own ``relay publish`` (default settings,
   the look-ahead widened to reach the minute's end): each run publishes short waits
   behind the long ones of the runs before it, which is what held deliveries back in one
   timer queue of per-message TTLs (a classic queue expires only its head);
3. when every row is delivered, from the ledger: lateness as (a) the request's start minus
   the due time and (b) the receiver's acceptance (``finished_at``) minus the due time,
   p50/p95/p99/max; sends started before due (must be none); and deliveries claimed after
   one of their lane due more than 0.1 s later (held back: must be none).

    .venv/bin/python bench/timer.py
    .venv/bin/python bench/timer.py --count 10000 --runs 10

Target (issue 24): p99 <= 1 s, nothing early, nothing held back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import asyncpg
from _common import RELAY, BenchEnv, bench_env, check, free_port, load_average, run_measured
from drain import _spawn, _stop, _wait_port

SPAN_SECONDS = 60.0
TIE_SECONDS = 0.1  # two due times closer than this are a tie (the ladder rounds to 50 ms)


def _write_groups(
    scratch: Path, destination: str, count: int, runs: int, first_due: datetime, seed: int
) -> list[Path]:
    rng = random.Random(seed)
    lines = [
        json.dumps(
            {
                "id": f"timer-{i:06d}",
                "channel": "webhook",
                "destination": destination,
                "payload": {"n": i},
                "due_at": (first_due + timedelta(seconds=rng.uniform(0, SPAN_SECONDS))).isoformat(),
                "urgent": rng.random() < 0.2,
            }
        )
        for i in range(count)
    ]
    rng.shuffle(lines)
    paths = []
    for k in range(runs):
        path = scratch / f"group{k}.jsonl"
        path.write_text("\n".join(lines[k::runs]) + "\n")
        paths.append(path)
    return paths


def _percentiles(values: list[float]) -> str:
    values = sorted(values)

    def at(share: float) -> float:
        return values[min(len(values) - 1, int(len(values) * share))]

    return f"p50 {at(0.5):.3f} / p95 {at(0.95):.3f} / p99 {at(0.99):.3f} / max {values[-1]:.3f} s"


def _held_back(rows: list[asyncpg.Record]) -> int:
    """Deliveries claimed after one of their lane due more than TIE_SECONDS later."""
    held = 0
    for urgent in (False, True):
        lane = sorted((r for r in rows if r["urgent"] is urgent), key=lambda r: r["claimed"])
        latest: float | None = None
        for row in lane:
            if latest is not None and row["due"] < latest - TIE_SECONDS:
                held += 1
            latest = row["due"] if latest is None else max(latest, row["due"])
    return held


async def _report(pool: asyncpg.Pool, count: int) -> None:
    rows = await pool.fetch(
        "SELECT d.urgent, extract(epoch FROM d.occurrence_at)::float8 AS due,"
        " extract(epoch FROM d.first_attempt_at)::float8 AS claimed,"
        " extract(epoch FROM a.started_at - d.occurrence_at)::float8 AS started,"
        " extract(epoch FROM d.finished_at - d.occurrence_at)::float8 AS accepted,"
        " d.published_at < d.occurrence_at AS ahead"
        " FROM deliveries AS d JOIN delivery_attempts AS a ON a.delivery_id = d.id"
        " WHERE d.state = 'delivered'"
    )
    early = sum(1 for r in rows if r["started"] < 0)
    ahead = sum(1 for r in rows if r["ahead"])
    print(f"   delivered {len(rows)} of {count}; admitted ahead {ahead}; started early {early}")
    print(f"   lateness, request started - due: {_percentiles([r['started'] for r in rows])}")
    print(f"   lateness, accepted - due:        {_percentiles([r['accepted'] for r in rows])}")
    print(f"   held back (claimed after one due > {TIE_SECONDS} s later): {_held_back(rows)}")


async def _admit(env: BenchEnv, groups: list[Path]) -> None:
    for k, path in enumerate(groups):
        load_command = [*RELAY, "reminders", "load", str(path)]
        load = run_measured(load_command, env.env(), env.scratch, "load")
        check(load, "relay reminders load")
        published = run_measured([*RELAY, "publish"], env.env(), env.scratch, f"publish{k}")
        check(published, "relay publish")
        print(f"   run {k}: {published.stdout.strip()} ({published.wall_seconds:.1f} s)")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--lead", type=float, default=25.0, help="s before the first due time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--max-in-flight", type=int, default=0, help="RELAY_PUBLISH_MAX_IN_FLIGHT (0: default)"
    )
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    print(f"timer: {args.count} due over a minute, {args.runs} runs; load {load_average()}")
    async with bench_env("timer", keep_scratch=args.keep_logs) as env:
        env.extra_env["RELAY_PUBLISH_LOOKAHEAD_SECONDS"] = str(args.lead + SPAN_SECONDS + 30)
        if args.max_in_flight:
            env.extra_env["RELAY_PUBLISH_MAX_IN_FLIGHT"] = str(args.max_in_flight)
        port = free_port()
        receiver = [sys.executable, str(Path(__file__).with_name("receiver.py"))]
        partner = _spawn([*receiver, "--port", str(port)], env.env(), env.scratch / "partner.log")
        consumer: subprocess.Popen[bytes] | None = None
        try:
            await _wait_port(port, partner)
            consumer = _spawn([*RELAY, "consume"], env.env(), env.scratch / "consumer.log")
            first_due = datetime.now(UTC) + timedelta(seconds=args.lead)
            destination = f"http://127.0.0.1:{port}/hooks/bench"
            groups = _write_groups(
                env.scratch, destination, args.count, args.runs, first_due, args.seed
            )
            await _admit(env, groups)
            pool = await asyncpg.create_pool(env.database_url, min_size=1, max_size=2)
            deadline = time.monotonic() + args.lead + SPAN_SECONDS + 240
            while time.monotonic() < deadline:
                done = await pool.fetchval(
                    "SELECT count(*) FROM deliveries WHERE state = 'delivered'"
                )
                if done == args.count:
                    break
                await asyncio.sleep(1.0)
            await _report(pool, args.count)
            await pool.close()
        finally:
            if consumer is not None:
                _stop(consumer)
            _stop(partner)


if __name__ == "__main__":
    asyncio.run(main())
