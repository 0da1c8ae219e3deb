"""Retention at scale: batched deletes against the real schema vs dropping whole monthly
partitions of a declaratively partitioned copy (issue 27, item 2).

One scratch database ``bench_partitions_<pid>`` (``CREATE DATABASE`` + ``relay migrate``,
dropped at the end) holds:

* the real ``deliveries`` / ``delivery_attempts``: N old final deliveries (default
  2,000,000, created 2025-12-01 .. 2026-10-01, ~1.5 attempts each) and R recent ones
  (default 200,000, 2026-10-01 .. 2026-12-01, 1 % still queued) that must stay;
* a copy of the same rows in ``pdeliveries`` / ``pdeliveries_attempts``, partitioned by
  month of ``created_at`` (attempts carry their delivery's ``created_at``: the foreign key
  to a partitioned table must name its whole primary key ``(id, created_at)``, and the
  unique idempotency key becomes ``(idempotency_key, created_at)``). Building it is what
  migrating existing data would cost: time and WAL are printed.

Then, for the same cutoff (2026-10-01: the N old rows):

(a) batched deletes, B rows per transaction (default 5,000): walk the primary key by id
    range, lock the final old rows of the range ``FOR UPDATE SKIP LOCKED`` (or
    ``--plain``: no lock clause, the DELETE's own row locks and state guard), delete their
    attempts and them in one statement; then a plain VACUUM (autovacuum is off on the
    shared server this was written on; a deployment runs it, and it does this work);
(b) per old month: check the partition holds nothing open or recent, ``DETACH PARTITION
    ... CONCURRENTLY`` and ``DROP TABLE`` for attempts, then for deliveries.

Printed per strategy: wall time, WAL bytes (``pg_current_wal_lsn`` difference: the whole
server's, other sessions' included, so the WAL of our own statements from ``EXPLAIN
(ANALYZE, WAL)`` is printed beside it for (a)), table + index size after, dead tuples.

    .venv/bin/python bench/partitions.py                          # 2,000,000 old rows
    .venv/bin/python bench/partitions.py --old 20000 --recent 2000  # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _retention as ret
import asyncpg
from _common import RELAY, REPO, check, db_url, load_average, run_measured

from service import db
from service.ledger.purge import purge
from service.retention import Policy
from service.retention_settings import CHANNELS
from service.settings import Settings

OLD_START = datetime(2025, 12, 1, tzinfo=UTC)
CUTOFF = datetime(2026, 10, 1, tzinfo=UTC)
RECENT_END = datetime(2026, 12, 1, tzinfo=UTC)
# Old rows are created (occurrence - 60 s) and finished (a dead one: + 1 h) inside their
# month, so both strategies remove exactly the same rows.
_MARGIN = timedelta(hours=2)
# partition bounds: 2025-12-01 .. 2027-01-01, monthly
MONTHS = [datetime(2025 + (11 + k) // 12, (11 + k) % 12 + 1, 1, tzinfo=UTC) for k in range(14)]

_VICTIMS = """
WITH victims AS (
    SELECT id FROM deliveries
    WHERE id > $1 AND id <= $2 AND state IN ('delivered', 'skipped', 'dead')
      AND finished_at < $3
    ORDER BY id {lock}
), gone_attempts AS (
    DELETE FROM delivery_attempts AS a USING victims AS v WHERE a.delivery_id = v.id
    RETURNING 1
), gone AS (
    DELETE FROM deliveries AS d USING victims AS v
    WHERE d.id = v.id AND d.state IN ('delivered', 'skipped', 'dead') AND d.finished_at < $3
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deliveries, (SELECT count(*) FROM gone_attempts)
"""


def _month_name(m: datetime) -> str:
    return f"{m.year}_{m.month:02d}"


async def _build_partitioned(conn: asyncpg.Connection) -> tuple[float, int, int]:
    """The partitioned copy, built as a migration would: bare tables and their monthly
    partitions, the rows copied, then keys, indexes and the foreign key (one validating
    join, not a check per row). Returns (seconds, WAL, WAL of the two copying INSERTs)."""
    started, lsn = time.monotonic(), await ret.wal_lsn(conn)
    await conn.execute(
        """
        CREATE TABLE pdeliveries (LIKE deliveries INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
            PARTITION BY RANGE (created_at);
        CREATE TABLE pdeliveries_attempts (
            LIKE delivery_attempts INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
            delivery_created_at timestamptz NOT NULL
        ) PARTITION BY RANGE (delivery_created_at);
        """
    )
    for lo, hi in itertools.pairwise(MONTHS):
        for table in ("pdeliveries", "pdeliveries_attempts"):
            await conn.execute(
                f"CREATE TABLE {table}_{_month_name(lo)} PARTITION OF {table}"
                f" FOR VALUES FROM ('{lo.isoformat()}') TO ('{hi.isoformat()}')"
            )
    own = 0
    for sql in (
        "INSERT INTO pdeliveries SELECT * FROM deliveries",
        "INSERT INTO pdeliveries_attempts SELECT a.*, d.created_at"
        " FROM delivery_attempts AS a JOIN deliveries AS d ON d.id = a.delivery_id",
    ):
        own += (await _explained(conn, sql))[1]
    await conn.execute(
        """
        ALTER TABLE pdeliveries ADD PRIMARY KEY (id, created_at),
            ADD UNIQUE (idempotency_key, created_at);
        ALTER TABLE pdeliveries_attempts
            ADD PRIMARY KEY (delivery_id, delivery_created_at, attempt);
        """
    )
    await _same_indexes(conn)
    await conn.execute(
        "ALTER TABLE pdeliveries_attempts ADD FOREIGN KEY (delivery_id, delivery_created_at)"
        " REFERENCES pdeliveries (id, created_at)"
    )
    return time.monotonic() - started, await ret.wal_since(conn, lsn), own


async def _same_indexes(conn: asyncpg.Connection) -> None:
    """Every other index of the real tables (migration 0018's purge indexes too), on the
    partitioned copy: the same columns and predicates."""
    for real, copy in (
        ("deliveries", "pdeliveries"),
        ("delivery_attempts", "pdeliveries_attempts"),
    ):
        rows = await conn.fetch(
            "SELECT pg_get_indexdef(indexrelid) AS ddl FROM pg_index"
            " WHERE indrelid = $1::regclass AND NOT indisunique",
            real,
        )
        for r in rows:
            tail = r["ddl"].split(f" ON public.{real} ", 1)[1]
            await conn.execute(f"CREATE INDEX ON {copy} {tail}")


async def _explained(conn: asyncpg.Connection, sql: str, *args: object) -> tuple[int, int]:
    """Run ``sql`` under EXPLAIN (ANALYZE, WAL): (rows of the top node, its WAL bytes)."""
    raw = await conn.fetchval(f"EXPLAIN (ANALYZE, WAL, TIMING OFF, FORMAT JSON) {sql}", *args)
    plan: dict[str, Any] = (raw if isinstance(raw, list) else json.loads(raw))[0]["Plan"]
    return int(plan.get("Actual Rows", 0)), int(plan.get("WAL Bytes", 0))


async def batched_delete(conn: asyncpg.Connection, batch: int, lock: str) -> dict[str, float]:
    """Strategy (a): one transaction per id range of ``batch`` rows. Each statement runs
    under EXPLAIN (ANALYZE, WAL, TIMING OFF) to count its own WAL (a few % of time)."""
    started, lsn = time.monotonic(), await ret.wal_lsn(conn)
    sql = _VICTIMS.format(lock=lock)
    after, own_wal, batches = 0, 0, 0
    while True:
        async with conn.transaction():
            upto = await conn.fetchval(
                "SELECT max(id) FROM (SELECT id FROM deliveries WHERE id > $1"
                " ORDER BY id LIMIT $2) AS page",
                after,
                batch,
            )
            if upto is None:
                break
            own_wal += (await _explained(conn, sql, after, upto, CUTOFF))[1]
        after, batches = upto, batches + 1
        if batches % 40 == 0:
            print(f"   (a) {batches} batches, {time.monotonic() - started:.0f} s", flush=True)
    return {
        "seconds": time.monotonic() - started,
        "wal": await ret.wal_since(conn, lsn),
        "own_wal": own_wal,
        "batches": batches,
    }


async def relay_purge(conn: asyncpg.Connection, url: str, batch: int) -> dict[str, float]:
    """Strategy (a) as shipped: ``service.ledger.purge.purge`` (what ``relay purge`` runs), every
    period 30 days, as of CUTOFF + 30 days (so its cutoffs are CUTOFF)."""
    days = 30
    policy = Policy(
        content_days=dict.fromkeys(CHANNELS, days),
        rows_days=dict.fromkeys(CHANNELS, days),
        dead_content_days=days,
        dead_rows_days=days,
        runs_days=0,  # forever: only deliveries and their attempts are compared
        audit_days=0,
    )
    pool = await db.create_pool(Settings(database_url=url), size=2)
    started, lsn = time.monotonic(), await ret.wal_lsn(conn)
    try:
        summary = await purge(pool, policy, CUTOFF + timedelta(days=days), batch_size=batch)
    finally:
        await pool.close()
    return {
        "seconds": time.monotonic() - started,
        "wal": await ret.wal_since(conn, lsn),
        "own_wal": float("nan"),
        "batches": summary.batches,
    }


async def partition_drop(conn: asyncpg.Connection) -> dict[str, float]:
    """Strategy (b): detach concurrently and drop each old month, attempts first."""
    started, lsn = time.monotonic(), await ret.wal_lsn(conn)
    checks = 0.0
    for month in [m for m in MONTHS[:-1] if m < CUTOFF]:
        part = f"pdeliveries_{_month_name(month)}"
        t = time.monotonic()
        blocked = await conn.fetchval(
            f"SELECT EXISTS (SELECT 1 FROM {part} WHERE state NOT IN"
            " ('delivered', 'skipped', 'dead') OR finished_at >= $1)",
            CUTOFF,
        )
        checks += time.monotonic() - t
        if blocked:
            print(f"   (b) {part} holds open or recent rows: kept (batched deletes instead)")
            continue
        for table in (f"pdeliveries_attempts_{_month_name(month)}", part):
            parent = table.rsplit("_", 2)[0]
            await conn.execute(f"ALTER TABLE {parent} DETACH PARTITION {table} CONCURRENTLY")
            await conn.execute(f"DROP TABLE {table}")
    return {
        "seconds": time.monotonic() - started,
        "wal": await ret.wal_since(conn, lsn),
        "check_seconds": checks,
    }


async def _vacuum(conn: asyncpg.Connection) -> tuple[float, int]:
    started, lsn = time.monotonic(), await ret.wal_lsn(conn)
    await conn.execute("VACUUM deliveries")
    await conn.execute("VACUUM delivery_attempts")
    return time.monotonic() - started, await ret.wal_since(conn, lsn)


async def _load(conn: asyncpg.Connection, args: argparse.Namespace) -> None:
    seconds = await ret.seed(
        conn,
        first_id=1,
        count=args.old,
        start=OLD_START + _MARGIN,
        end=CUTOFF - _MARGIN,
        content_purged=True,  # as a daily purge leaves them: only the rows are left to go
        label="old",
    )
    seconds += await ret.seed(
        conn,
        first_id=args.old + 1,
        count=args.recent,
        start=CUTOFF + _MARGIN,
        end=RECENT_END,
        queued_share=0.01,
        label="recent",
    )
    await conn.execute("VACUUM ANALYZE deliveries")
    await conn.execute("VACUUM ANALYZE delivery_attempts")
    print(f"   loaded in {seconds:.0f} s (+ VACUUM ANALYZE)", flush=True)


async def _lookups(conn: asyncpg.Connection, pages: int = 200, size: int = 200) -> str:
    """The consumer finds its rows by id alone, which is not the partition key: each id is
    looked for in every partition. Median time of one page of ``size`` random ids."""
    rng = random.Random(1)
    top = int(await conn.fetchval("SELECT max(id) FROM deliveries"))
    out = []
    for table in ("deliveries", "pdeliveries"):
        sql = f"SELECT id, state FROM {table} WHERE id = ANY($1::bigint[])"
        stmt = await conn.prepare(sql)
        times = []
        for _ in range(pages):
            ids = [rng.randint(1, top) for _ in range(size)]
            t = time.perf_counter()
            await stmt.fetch(ids)
            times.append(time.perf_counter() - t)
        plan = await ret.plan_of(conn, sql, [1, 2])
        out.append(
            f"{table} {statistics.median(times) * 1000:.2f} ms per {size} ids "
            f"({len([n for n in plan if 'Scan' in n])} index scans in its plan)"
        )
    return "; ".join(out)


async def run(conn: asyncpg.Connection, url: str, args: argparse.Namespace) -> None:
    await _load(conn, args)
    total = await ret.counts(conn)
    build_s, build_wal, build_own = await _build_partitioned(conn)
    await conn.execute("VACUUM ANALYZE pdeliveries, pdeliveries_attempts")
    print(
        f"rows: {total[0]:,} deliveries, {total[1]:,} attempts; before: "
        f"{await ret.pair_sizes(conn, 'deliveries')}\n"
        f"migration to the partitioned layout (bare tables, INSERT ... SELECT, then keys, "
        f"indexes and the foreign key): {build_s:.1f} s, WAL {ret.mb(build_wal)} (own statements "
        f"{ret.mb(build_own)}); partitioned before: {await ret.pair_sizes(conn, 'pdeliveries')}",
        flush=True,
    )
    print(f"lookups by id (as the claim and the outcome write do): {await _lookups(conn)}")
    lock = "" if args.plain else "FOR UPDATE SKIP LOCKED"
    if args.strategy == "relay":
        how = (
            "service.ledger.purge.purge, as relay purge runs it: by (finished_at, id), SKIP LOCKED"
        )
        a = await relay_purge(conn, url, args.batch)
    else:
        how = f"one statement by id range, {lock or 'no lock clause'}"
        a = await batched_delete(conn, args.batch, lock)
    after = await ret.counts(conn)
    rate = (total[0] - after[0]) / a["seconds"]
    own = f" (own statements {ret.mb(a['own_wal'])})" if a["own_wal"] == a["own_wal"] else ""
    print(
        f"(a) batched deletes ({args.batch:,} per transaction; {how}): "
        f"{total[0] - after[0]:,} deliveries + {total[1] - after[1]:,} attempts in "
        f"{a['batches']:.0f} transactions, {a['seconds']:.1f} s ({rate:,.0f} deliveries/s); "
        f"WAL {ret.mb(a['wal'])}{own}\n"
        f"    after: {await ret.pair_sizes(conn, 'deliveries')}\n"
        f"    tuples: {await ret.tuples(conn)}",
        flush=True,
    )
    vac_s, vac_wal = await _vacuum(conn)
    print(
        f"    VACUUM of both tables: {vac_s:.1f} s, WAL {ret.mb(vac_wal)}; after: "
        f"{await ret.pair_sizes(conn, 'deliveries')}\n    tuples: {await ret.tuples(conn)}\n"
        f"    {await ret.bloat(conn, 'deliveries')}\n"
        f"    {await ret.bloat(conn, 'delivery_attempts')}",
        flush=True,
    )
    b = await partition_drop(conn)
    left = await ret.counts(conn, "pdeliveries")
    print(
        f"(b) partitions dropped (DETACH CONCURRENTLY + DROP, attempts first): "
        f"{total[0] - left[0]:,} deliveries + {total[1] - left[1]:,} attempts in "
        f"{b['seconds']:.1f} s (of which the 'nothing open or recent' checks "
        f"{b['check_seconds']:.1f} s); WAL {ret.mb(b['wal'])}\n"
        f"    after: {await ret.pair_sizes(conn, 'pdeliveries')}",
        flush=True,
    )
    same = left == after
    print(f"rows left: real {after}, partitioned {left}: {'same' if same else 'DIFFERENT'}")
    if not same:
        raise SystemExit("the two strategies removed different rows")


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--old", type=int, default=2_000_000, help="old final deliveries")
    parser.add_argument("--recent", type=int, default=200_000, help="recent deliveries kept")
    parser.add_argument("--batch", type=int, default=5_000, help="rows per transaction")
    parser.add_argument(
        "--strategy",
        choices=("relay", "sql"),
        default="relay",
        help="(a): relay = service.ledger.purge.purge (default); sql = one statement per id range",
    )
    parser.add_argument("--plain", action="store_true", help="sql without SKIP LOCKED")
    parser.add_argument("--keep", action="store_true", help="keep the database (debugging)")
    args = parser.parse_args()
    name = f"bench_partitions_{os.getpid()}"
    admin = await asyncpg.connect(db_url("postgres"))
    autovacuum = await admin.fetchval("SHOW autovacuum")
    print(
        f"== partitions: {args.old:,} old + {args.recent:,} recent deliveries, batch "
        f"{args.batch:,}; database {name}; server autovacuum {autovacuum}; load average "
        f"{load_average()}; {os.cpu_count()} CPUs",
        flush=True,
    )
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        env = {**os.environ, "RELAY_DATABASE_URL": db_url(name), "PYTHONPATH": str(REPO)}
        with tempfile.TemporaryDirectory(prefix=f"{name}-") as scratch:
            migrate = run_measured([*RELAY, "migrate"], env, Path(scratch), "migrate")
            check(migrate, "relay migrate")
        conn = await asyncpg.connect(db_url(name))
        try:
            await run(conn, db_url(name), args)
        finally:
            await conn.close()
    finally:
        if not args.keep:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
