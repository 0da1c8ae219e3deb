"""Purge under a drain: does ``relay purge`` of 2 million old rows slow a 20,000-delivery
drain (issue 27, item 2's proof)?

Once: a template database (``CREATE DATABASE`` + ``relay migrate``) loaded with N old final
deliveries (default 2,000,000; ~1.5 attempts each; ended 380 to 200 days ago, so past every
default period, the dead one's too) whose content a daily purge has already removed (the
purge's work is deleting rows; ``--with-content`` keeps payloads and excerpts, as the first
purge after an upgrade finds them: its content step reads and passes over the rows its rows
step deletes). Then pairs of runs, back to back, alternating which goes first; each run on
a fresh copy of the template (``CREATE DATABASE ... TEMPLATE ... STRATEGY FILE_COPY``) and
its own broker namespace:

* as ``bench/drain.py``: the lean receiver, 20,000 reminders due now loaded and queued
  (``relay reminders load`` + ``relay publish``), then ONE ``relay consume`` drains them;
* ``alone``: nothing else; ``purge``: ``relay purge`` (a subprocess, default settings but
  its pace, ``--rows-per-second``, default relay purge's own, 1,500, 0: unpaced; and its
  wait for due deliveries, ``--yield-seconds``, default relay purge's own, 1,800, 0: never
  waits) is started first, on a ledger with nothing due, as a nightly purge of a big
  backlog runs into the 06:00 wave; once it has deleted its first rows the reminders are
  loaded and published and the consumer drains them. The purge must still be running when
  the drain ends (else the run says so), then it gets SIGTERM.

Per run: deliveries/s (whole drain, and 10-90 %; progress read from the receiver's count
every 100 ms, so the measurement puts no query on the database while it drains); lateness
read from the ledger as ``bench/lateness.py`` reads it (``finished_at`` minus the due
time), with every drained reminder taken as due when the consumer starts (the database's
clock just before): the raw ``finished_at - occurrence_at`` also counts the load, the
publish and, with the purge, the wait for its first deletes, so it is printed but not
judged; the CPU of every process, and every 100 ms what each backend of the database is
doing
(``pg_stat_activity``: wait event, or CPU when active without one), by client
(``application_name``: relay-consume, relay-purge). Targets (issue 27): deliveries/s
changed by < 10 %, lateness p99 by < 0.5 s.

    .venv/bin/python bench/purge_under_drain.py                          # 3 pairs, 2,000,000
    .venv/bin/python bench/purge_under_drain.py --old 20000 --pairs 1 --count 2000  # a look
    .venv/bin/python bench/purge_under_drain.py --rows-per-second 0     # unpaced, as before
    .venv/bin/python bench/purge_under_drain.py --yield-seconds 0       # paced, never waits
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _retention as ret
import asyncpg
from _common import (
    BASE_DB_URL,
    RELAY,
    BenchEnv,
    CpuMonitor,
    bench_env,
    delete_namespace,
    describe_groups,
    free_port,
    load_average,
    median,
)
from drain import _partner_stats, _prepare, _spawn, _stop, _wait_port
from lateness import _percentile

from service import db
from service.retention_settings import RetentionSettings

TARGET_RATIO = 0.10
TARGET_P99_SECONDS = 0.5


@asynccontextmanager
async def template(args: argparse.Namespace) -> AsyncIterator[BenchEnv]:
    """The loaded template: its own database (migrated by bench_env), N old rows."""
    async with bench_env("pud_tpl") as env:
        conn = await asyncpg.connect(env.database_url)
        try:
            now = datetime.now(UTC)
            await ret.seed(
                conn,
                first_id=1,
                count=args.old,
                start=now - timedelta(days=380),
                end=now - timedelta(days=200),
                content_purged=not args.with_content,
                label="old",
            )
            await conn.execute("VACUUM ANALYZE deliveries")
            await conn.execute("VACUUM ANALYZE delivery_attempts")
            sizes = await ret.relation_sizes(conn, "deliveries")
            attempts = await ret.relation_sizes(conn, "delivery_attempts")
            # The consumer's sampler counts every row by state every few seconds.
            started = time.monotonic()
            await conn.fetch(db.q("overall_state_counts"))
            counting = time.monotonic() - started
            probe = await _probe_ms(conn)
        finally:
            await conn.close()
        print(
            f"   template {env.database}: deliveries {ret.mb(sizes['total'])}, "
            f"attempts {ret.mb(attempts['total'])}; overall_state_counts (the consumer's "
            f"sampler) {counting * 1000:.0f} ms; the purge's probe for due deliveries "
            f"(purge_due_work) {probe:.2f} ms",
            flush=True,
        )
        yield env


async def _probe_ms(conn: asyncpg.Connection, times: int = 20) -> float:
    """The median time of the purge's probe for due deliveries, warm (what it asks every
    second while it waits)."""
    took = []
    for _ in range(times):
        started = time.monotonic()
        await conn.fetchval(db.q("purge_due_work"))
        took.append((time.monotonic() - started) * 1000)
    return median(took)


@asynccontextmanager
async def cloned(tpl: BenchEnv, keep_logs: bool = False) -> AsyncIterator[BenchEnv]:
    """A fresh file copy of the template, a broker namespace and a scratch directory of
    its own; all removed at the end."""
    tag = uuid.uuid4().hex[:8]
    env = BenchEnv(
        name="pud",
        database=f"relay_bench_pud_{tag}",
        namespace=f"bench-{tag}",
        secret=tpl.secret,
        scratch=Path(tempfile.mkdtemp(prefix="relay-bench-pud-")),
    )
    admin = await asyncpg.connect(BASE_DB_URL)
    try:
        await admin.execute(
            f'CREATE DATABASE "{env.database}" TEMPLATE "{tpl.database}" STRATEGY FILE_COPY'
        )
        yield env
    finally:
        try:
            await delete_namespace(env.namespace)
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{env.database}" WITH (FORCE)')
            await admin.close()
            if keep_logs:
                print(f"   (logs kept in {env.scratch})")
            else:
                shutil.rmtree(env.scratch, ignore_errors=True)


@dataclass
class Run:
    mode: str
    count: int
    wall: float
    steady: float
    first: float  # seconds from the consumer's start to its first delivery
    # p50, p99, max of finished_at - the consumer's start (every reminder due by then)
    late: tuple[float, float, float]
    raw_p99: float  # finished_at - occurrence_at (load and publish included)
    deleted: int  # deliveries the purge deleted while the consumer drained
    overlapped: bool | None  # the purge still ran when the drain ended
    groups: dict[str, float]
    activity: str

    @property
    def rate(self) -> float:
        return self.count / self.wall


async def _deleted(pool: asyncpg.Pool) -> int:
    """Deliveries the purge has deleted so far: its run's record, which each batch updates
    in its own transaction (exact, unlike the statistics, which a backend may flush ~10 s
    late)."""
    return int(
        await pool.fetchval(
            "SELECT coalesce(sum((counts ->> 'deliveries/rows')::bigint), 0) FROM purge_runs"
        )
    )


async def _purging(pool: asyncpg.Pool, purge: Any, timeout: float = 600) -> None:
    """Until the purge has deleted its first deliveries."""
    deadline = time.monotonic() + timeout
    while await _deleted(pool) == 0:
        if purge.poll() is not None:
            raise SystemExit(f"relay purge exited {purge.returncode} before deleting anything")
        if time.monotonic() > deadline:
            raise SystemExit(f"relay purge deleted nothing in {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def _drained(
    args: argparse.Namespace, pool: asyncpg.Pool, port: int, consumer: Any, started: float
) -> list[tuple[float, int]]:
    """Progress from the receiver's count of logical events every 100 ms (no query on the
    database meanwhile), then the ledger until every drained row is 'delivered' (ids above
    the template's); the last sample is that moment."""
    samples: list[tuple[float, int]] = []
    done, delivered = 0, 0
    while delivered < args.count:
        if consumer.poll() is not None:
            raise SystemExit(f"consumer exited {consumer.returncode} early")
        if time.monotonic() - started > args.timeout:
            raise SystemExit(f"timed out after {args.timeout} s: {done} received")
        if done < args.count:
            done = int(str((await _partner_stats(port)).get("logical_events", 0)))
            samples.append((time.monotonic() - started, done))
        else:
            delivered = int(
                await pool.fetchval(
                    "SELECT count(*) FROM deliveries WHERE id > $1 AND state = 'delivered'",
                    args.old,
                )
            )
        if delivered < args.count:
            await asyncio.sleep(0.1)
    samples.append((time.monotonic() - started, delivered))
    return samples


def _steady(samples: list[tuple[float, int]], count: int) -> float:
    def at(fraction: float) -> tuple[float, int]:
        return next(s for s in samples if s[1] >= count * fraction)

    (t10, n10), (t90, n90) = at(0.1), at(0.9)
    return (n90 - n10) / (t90 - t10) if t90 > t10 else float("nan")


async def _lateness(pool: asyncpg.Pool, base: int, started: datetime) -> tuple[Any, float]:
    rows = await pool.fetch(
        "SELECT extract(epoch FROM finished_at - occurrence_at)::float8 AS late,"
        " extract(epoch FROM finished_at - $2)::float8 AS since"
        " FROM deliveries WHERE id > $1 AND state = 'delivered'",
        base,
        started,
    )
    late = sorted(r["late"] for r in rows)
    since = sorted(r["since"] for r in rows)
    p = (_percentile(since, 0.5), _percentile(since, 0.99), since[-1])
    return p, _percentile(late, 0.99)


def _with_app(env: BenchEnv, app: str) -> str:
    return f"{env.database_url}?application_name={app}"


def _start_purge(args: argparse.Namespace, env: BenchEnv) -> Any:
    return _spawn(
        args.purge_command,
        env.env(
            database_url=_with_app(env, "relay-purge"),
            retention_purge_rows_per_second=str(args.rows_per_second),
            retention_purge_yield_seconds=str(args.yield_seconds),
        ),
        env.scratch / "purge.log",
    )


async def _measure(
    args: argparse.Namespace, env: BenchEnv, port: int, purge: Any, monitor: CpuMonitor
) -> Run:
    """Start the consumer (beside ``purge``, if one runs); measure the drain."""
    mode = "alone" if purge is None else "purge"
    pool = await asyncpg.create_pool(
        env.database_url, min_size=1, max_size=2, server_settings={"application_name": "bench"}
    )
    consumer = None
    try:
        base = args.old  # the template's rows are 1..old; the drained ones come after
        if purge is not None:
            monitor.ours[purge.pid] = "purge"
        deleted0 = await _deleted(pool)
        async with ret.Activity(env.database_url) as activity:
            started, db_started = time.monotonic(), await pool.fetchval("SELECT now()")
            consumer = _spawn(
                [*RELAY, "consume"],
                env.env(
                    database_url=_with_app(env, "relay-consume"),
                    prefetch=str(args.prefetch),
                    database_pool_size=str(args.pool_size),
                    write_batch_max=str(args.write_batch),
                ),
                env.scratch / "consumer.log",
            )
            monitor.ours[consumer.pid] = "consumer"
            samples = await _drained(args, pool, port, consumer, started)
        wall = samples[-1][0]
        groups = monitor.stop()
        overlapped = purge.poll() is None if purge is not None else None
        deleted = await _deleted(pool) - deleted0
        late, raw_p99 = await _lateness(pool, base, db_started)
    finally:
        if consumer is not None:
            _stop(consumer)
        await pool.close()
    return Run(
        mode, args.count, wall, _steady(samples, args.count),
        next(t for t, n in samples if n > 0), late, raw_p99, deleted,
        overlapped, groups, activity.describe(),
    )  # fmt: skip


async def one_run(args: argparse.Namespace, tpl: BenchEnv, number: int, mode: str) -> Run:
    async with cloned(tpl, args.keep_logs) as env:
        port = free_port()
        receiver = [sys.executable, str(Path(__file__).with_name("receiver.py"))]
        partner = _spawn([*receiver, "--port", str(port)], env.env(), env.scratch / "partner.log")
        purge = None
        try:
            await _wait_port(port, partner)
            if mode == "purge":
                purge = _start_purge(args, env)
                async with asyncpg.create_pool(env.database_url, min_size=1, max_size=1) as pool:
                    await _purging(pool, purge)
            await _prepare(args, env, port)
            monitor = CpuMonitor().start()
            monitor.ours[partner.pid] = "partner"
            run = await _measure(args, env, port, purge, monitor)
            stats = await _partner_stats(port)
        finally:
            for proc in (purge, partner):
                if proc is not None:
                    _stop(proc)
    ok = stats.get("logical_events") == args.count and stats.get("bad_signatures") == 0
    p50, p99, worst = run.late
    purge = ""
    if mode == "purge":
        purge = (
            f" | purge deleted {run.deleted:,} deliveries meanwhile "
            f"({run.deleted / run.wall:,.0f}/s), "
            f"{'still running at the end' if run.overlapped else 'ENDED BEFORE THE DRAIN'}"
        )
    print(
        f"run {number} ({mode}): {run.wall:6.2f} s -> {run.rate:6.0f} deliveries/s (steady "
        f"10-90 %: {run.steady:6.0f}/s; first after {run.first:.1f} s) | lateness from the "
        f"consumer's start p50 {p50:.2f} s, p99 {p99:.2f} s, max {worst:.2f} s (from due, "
        f"load and publish included: p99 {run.raw_p99:.2f} s){purge} | partner "
        f"{'OK' if ok else 'MISMATCH ' + str(stats)}\n"
        f"   CPU during the drain: {describe_groups(run.groups, run.wall)}\n"
        f"   backends (pg_stat_activity every 100 ms): {run.activity}",
        flush=True,
    )
    if not ok:
        raise SystemExit("purge under drain: the receiver's counts do not match")
    return run


def _summary(pairs: list[tuple[Run, Run]], args: argparse.Namespace) -> None:
    """Per pair and the median: the change of deliveries/s with the purge (negative:
    slower; the target bounds the slowdown) and of lateness p99."""
    print(f"purge pace: {_pace(args)}")
    changes, deltas = [], []
    for i, (alone, purge) in enumerate(pairs, 1):
        change = purge.rate / alone.rate - 1
        delta = purge.late[1] - alone.late[1]
        changes.append(change)
        deltas.append(delta)
        print(
            f"pair {i}: alone {alone.rate:,.0f}/s, with purge {purge.rate:,.0f}/s "
            f"({change:+.1%}); lateness p99 {alone.late[1]:.2f} -> {purge.late[1]:.2f} s "
            f"({delta:+.2f} s; from due {purge.raw_p99 - alone.raw_p99:+.2f} s)"
        )
    change, delta = median(changes), median(deltas)
    print(
        f"median of {len(pairs)} pairs: deliveries/s {change:+.1%} with the purge (target: "
        f"slower by < {TARGET_RATIO:.0%}: {'met' if -change < TARGET_RATIO else 'MISSED'}); "
        f"lateness p99 {delta:+.2f} s (target < {TARGET_P99_SECONDS} s: "
        f"{'met' if delta < TARGET_P99_SECONDS else 'MISSED'}); worst pair "
        f"{min(changes):+.1%}, {max(deltas):+.2f} s"
    )


def _pace(args: argparse.Namespace) -> str:
    pace = f"at most {args.rows_per_second:,} rows/s per step (--rows-per-second)"
    if args.rows_per_second == 0:
        pace = "unpaced (--rows-per-second 0)"
    if args.yield_seconds == 0:
        return pace + ", never waits for due deliveries (--yield-seconds 0)"
    return pace + f", waits up to {args.yield_seconds:,} s for due deliveries (--yield-seconds)"


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--old", type=int, default=2_000_000, help="old final deliveries")
    parser.add_argument("--count", type=int, default=20_000, help="drained deliveries")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of runs (3)")
    parser.add_argument("--with-content", action="store_true", help="old rows keep content")
    parser.add_argument("--prefetch", type=int, default=200)
    parser.add_argument("--pool-size", type=int, default=10)
    parser.add_argument("--write-batch", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=300.0, help="per drain (s)")
    parser.add_argument("--keep-logs", action="store_true", help="keep each run's logs")
    parser.add_argument(
        "--purge-command",
        type=shlex.split,
        default=[*RELAY, "purge"],
        help="what runs as the purge (default: relay purge)",
    )
    parser.add_argument(
        "--rows-per-second",
        type=int,
        default=RetentionSettings.model_fields["retention_purge_rows_per_second"].default,
        help="the purge's pace (RELAY_RETENTION_PURGE_ROWS_PER_SECOND; default relay "
        "purge's own; 0: unpaced)",
    )
    parser.add_argument(
        "--yield-seconds",
        type=int,
        default=RetentionSettings.model_fields["retention_purge_yield_seconds"].default,
        help="how long the purge may wait for due deliveries in all "
        "(RELAY_RETENTION_PURGE_YIELD_SECONDS; default relay purge's own; 0: never waits)",
    )
    args = parser.parse_args()
    print(
        f"== purge under drain: {args.old:,} old rows "
        f"({'with' if args.with_content else 'content already purged'}), drains of "
        f"{args.count:,}, {args.pairs} pairs, purge {_pace(args)}; load "
        f"average {load_average()}; "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    pairs: list[tuple[Run, Run]] = []
    async with template(args) as tpl:
        for i in range(args.pairs):
            order = ("alone", "purge") if i % 2 == 0 else ("purge", "alone")
            runs = {
                mode: await one_run(args, tpl, 2 * i + n + 1, mode) for n, mode in enumerate(order)
            }
            pairs.append((runs["alone"], runs["purge"]))
    _summary(pairs, args)


if __name__ == "__main__":
    asyncio.run(main())
