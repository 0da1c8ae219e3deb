"""Fan-out benchmark: N events (default 10,000), each taken by S subscribers (default 5),
recorded with ``outbox.add_event`` by one application process -> N x S deliveries.

Per run (fresh database ``relay_bench_fanout_*`` and broker namespace ``bench-*``): the
catalogue (one type with a JSON Schema), S destinations registered with their own secrets
and subscribed (through the real CLI), then

1. admission: one application process (this script with ``--child``) records the N events,
   ``--batch`` per transaction (the application's transaction, as in examples/), each
   fanned out in that transaction: events/s and deliveries/s, the process's peak RSS and
   CPU (wait4), and the CPU of every process meanwhile (PostgreSQL's backends included);
2. one ``relay publish``, whose pending sweep publishes the N x S deliveries: its rate,
   peak RSS and CPU.

Checks that N events and N x S deliveries were recorded (each key once) and that every
delivery ended ``queued`` with as many messages in the lane queue.

    .venv/bin/python bench/fanout.py                         # 10,000 events x 5 = 50,000
    .venv/bin/python bench/fanout.py --count 2000 --batch 1  # one transaction per event
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
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
)
from cryptography.fernet import Fernet

EVENT_TYPE = "shipment.delayed"
SCHEMA = {
    "type": "object",
    "required": ["shipment", "eta", "region"],
    "properties": {
        "shipment": {"type": "integer"},
        "eta": {"type": "string"},
        "region": {"type": "string", "enum": ["eu", "us"]},
    },
}


async def child(database_url: str, count: int, batch: int) -> None:
    """The application: record ``count`` events, ``batch`` per transaction."""
    from service import outbox

    pool = await asyncpg.create_pool(
        database_url, min_size=1, max_size=1, init=outbox.prepare_connection
    )
    made = 0
    try:
        for start in range(0, count, batch):
            async with pool.acquire() as conn, conn.transaction():
                for n in range(start, min(start + batch, count)):
                    done = await outbox.add_event(
                        conn,
                        key=f"shipment:{n}:delayed",
                        event_type=EVENT_TYPE,
                        payload={"shipment": n, "eta": "2026-03-02T10:00:00Z", "region": "eu"},
                    )
                    made += 0 if done is None else done.deliveries
    finally:
        await pool.close()
    print(f"recorded={count} deliveries={made}")


@dataclass
class FanoutRun:
    events: int
    deliveries: int
    admit_seconds: float
    admit_rss_mb: float
    admit_cpu_seconds: float
    admit_groups: dict[str, float]
    machine_busy: float
    publish_seconds: float
    publish_rss_mb: float
    published: int

    @property
    def events_per_second(self) -> float:
        return self.events / self.admit_seconds


async def _setup(relay_env: dict[str, str], scratch: Path, subscribers: int) -> None:
    schema = scratch / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    steps = [["event-types", "add", EVENT_TYPE, "--schema", str(schema)]]
    for n in range(subscribers):
        url = f"http://127.0.0.1:9/hooks/partner-{n}"
        steps.append(["destinations", "add", url])
        pattern = EVENT_TYPE if n % 2 else "shipment.*"  # exact names and prefixes alike
        steps.append(["destinations", "subscribe", url, pattern, "--filter", "region=eu"])
    for step in steps:
        check(run_measured([*RELAY, *step], relay_env, scratch, "setup"), " ".join(step[:2]))


async def one_run(args: argparse.Namespace, number: int) -> FanoutRun:
    async with bench_env("fanout", keep_scratch=args.keep_logs) as env:
        relay_env = env.env(destination_secrets_keys=Fernet.generate_key().decode())
        await _setup(relay_env, env.scratch, args.subscribers)
        cmd = [sys.executable, __file__, "--child", env.database_url]
        cmd += ["--count", str(args.count), "--batch", str(args.batch)]
        load = MachineLoad()
        monitor = CpuMonitor().start()
        admitted = run_measured(cmd, relay_env, env.scratch, "application", monitor)
        busy = load.stop()
        groups = monitor.stop()
        check(admitted, "the application (add_event)")
        made = int(re.search(r"deliveries=(\d+)", admitted.stdout).group(1))  # type: ignore[union-attr]

        published = run_measured([*RELAY, "publish"], relay_env, env.scratch, "publish")
        check(published, "relay publish")
        match = re.search(r"published=(\d+)", published.stdout)
        sent = int(match.group(1)) if match else 0

        pool = await asyncpg.create_pool(env.database_url, min_size=1, max_size=1)
        try:
            states = await state_counts(pool)
            events = int(await pool.fetchval("SELECT count(*) FROM events"))
            keys = int(
                await pool.fetchval("SELECT count(DISTINCT idempotency_key) FROM deliveries")
            )
        finally:
            await pool.close()
        depth = await queue_depth(env.namespace)
        owed = args.count * args.subscribers
        ok = events == args.count and made == keys == owed == states.get("queued", 0) == depth
        run = FanoutRun(
            events=args.count,
            deliveries=made,
            admit_seconds=admitted.wall_seconds,
            admit_rss_mb=admitted.max_rss_kb / 1024,
            admit_cpu_seconds=admitted.cpu_seconds,
            admit_groups=groups,
            machine_busy=busy,
            publish_seconds=published.wall_seconds,
            publish_rss_mb=published.max_rss_kb / 1024,
            published=sent,
        )
        print(
            f"run {number}: admission {run.admit_seconds:6.2f} s = "
            f"{run.events_per_second:6.0f} events/s ({made / run.admit_seconds:6.0f} "
            f"deliveries/s), application peak RSS {run.admit_rss_mb:5.1f} MB, CPU "
            f"{run.admit_cpu_seconds:5.2f} s, machine busy {busy:4.0%} | publish "
            f"{run.publish_seconds:6.2f} s = {sent / run.publish_seconds:6.0f} deliveries/s, "
            f"peak RSS {run.publish_rss_mb:5.1f} MB | events {events} ledger {states} "
            f"queue {depth} {'OK' if ok else 'MISMATCH'}\n"
            f"   CPU during admission, all processes: "
            f"{describe_groups(groups, admitted.wall_seconds)}",
            flush=True,
        )
        if not ok:
            raise SystemExit("fanout benchmark: the ledger does not hold what was recorded")
        return run


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=10_000, help="events (10000)")
    parser.add_argument("--subscribers", type=int, default=5, help="destinations (5)")
    parser.add_argument("--batch", type=int, default=100, help="events per transaction (100)")
    parser.add_argument("--runs", type=int, default=1, help="repeat with fresh state; median")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        await child(args.child, args.count, args.batch)
        return
    print(
        f"== fan-out benchmark: {args.count} events x {args.subscribers} subscribers, "
        f"{args.batch} per transaction, {args.runs} run(s); load average {load_average()}",
        flush=True,
    )
    runs = [await one_run(args, n + 1) for n in range(args.runs)]
    print(
        f"median of {len(runs)}: admission {median([r.events_per_second for r in runs]):.0f} "
        f"events/s ({median([r.deliveries / r.admit_seconds for r in runs]):.0f} deliveries/s), "
        f"application peak RSS {median([r.admit_rss_mb for r in runs]):.1f} MB; publish "
        f"{median([r.published / r.publish_seconds for r in runs]):.0f} deliveries/s, peak RSS "
        f"{median([r.publish_rss_mb for r in runs]):.1f} MB"
    )


if __name__ == "__main__":
    asyncio.run(main())
