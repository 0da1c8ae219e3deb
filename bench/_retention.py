"""Shared helpers of the retention benchmarks (``partitions.py``, ``purge_under_drain.py``,
``retention_soak.py``): fast loading of final deliveries and their attempts with
``generate_series`` (rows that match every CHECK of the real schema), relation sizes,
WAL positions and plan shapes.

The rows look like a year of a clinic's reminders: half schedule deliveries (a reminder
id and a publish run of their day, no copy of the content), half outbox webhooks (a
destination URL and a JSON payload of ~100 bytes); random-order idempotency keys (so the
unique index is touched all over, as real keys are); 97 % delivered (half after one
attempt, half after a retry), 2 % skipped (stale), 1 % dead after 5 attempts: ~1.5
attempt rows per delivery, each with a short response excerpt.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from datetime import datetime
from typing import Any

import asyncpg

BATCH = 200_000  # rows per INSERT statement (one transaction each)
FINAL = ("delivered", "skipped", "dead")

# $1 first id, $2 last id, $3 first occurrence, $4 seconds between occurrences,
# $5 first run id (one publish run per day from $3), $6 share of rows left 'queued'
# (recent rows only: a final-only load passes 0).
_DELIVERIES = """
INSERT INTO deliveries (id, idempotency_key, reminder_id, source, channel, destination, payload,
    occurrence_at, state, attempts, last_status, last_error, skip_reason, run_id, created_at,
    published_at, first_attempt_at, finished_at, dead_lettered_at{cols})
SELECT i, md5(i::text) || ':' || i,
    CASE WHEN sched THEN 'rem-' || (i % 50000) END,
    CASE WHEN sched THEN 'schedule' ELSE 'outbox' END, 'webhook',
    CASE WHEN NOT sched THEN 'https://partner-' || (i % 20) || '.example.org/hooks/reminders' END,
    CASE WHEN NOT sched AND NOT {purged} THEN jsonb_build_object('text',
        'Your appointment is tomorrow at 09:30. Reply STOP to cancel.', 'n', i) END,
    occ, st::delivery_state,
    CASE st WHEN 'delivered' THEN 1 + (i / 2) % 2 WHEN 'dead' THEN 5 ELSE 0 END,
    CASE st WHEN 'delivered' THEN 200 WHEN 'dead' THEN 500 END,
    CASE WHEN st = 'dead' THEN 'HTTP 500 from the partner' END,
    CASE WHEN st = 'skipped' THEN 'stale' END,
    CASE WHEN sched THEN $5::bigint + floor(extract(epoch FROM occ - $3) / 86400)::bigint END,
    occ - interval '60 s', occ - interval '10 s',
    CASE WHEN st IN ('delivered', 'dead') THEN occ + interval '50 ms' END,
    CASE st WHEN 'queued' THEN NULL WHEN 'dead' THEN occ + interval '1 h'
            ELSE occ + (1 + (i / 2) % 2) * interval '200 ms' END,
    CASE WHEN st = 'dead' THEN occ + interval '1 h' END{vals}
FROM (SELECT i, i % 2 = 0 AS sched, $3::timestamptz + (i - $1) * make_interval(secs => $4) AS occ,
             CASE WHEN i % 100 = 3 THEN 'dead' WHEN i % 50 = 2 THEN 'skipped'
                  WHEN random() < $6 THEN 'queued' ELSE 'delivered' END AS st
      FROM generate_series($1::bigint, $2::bigint) AS i) AS s
"""

_ATTEMPTS = """
INSERT INTO delivery_attempts (delivery_id, attempt, outcome, http_status, latency_ms,
    response_excerpt, started_at, finished_at)
SELECT d.id, a,
    CASE WHEN d.state = 'delivered' AND a = d.attempts THEN 'accepted' ELSE 'retry' END,
    CASE WHEN d.state = 'delivered' AND a = d.attempts THEN 200 ELSE 503 END,
    20 + d.id % 300,
    CASE WHEN {purged} THEN NULL
         WHEN d.state = 'delivered' AND a = d.attempts
             THEN '{{"ok":true,"id":"msg_' || d.id || '"}}'
         ELSE 'Service Unavailable: try again later' END,
    d.first_attempt_at + (a - 1) * interval '30 s',
    d.first_attempt_at + (a - 1) * interval '30 s' + interval '100 ms'
FROM deliveries AS d CROSS JOIN LATERAL generate_series(1, d.attempts) AS a
WHERE d.id BETWEEN $1 AND $2
"""

_RUNS = """
INSERT INTO publish_runs (id, kind, status, intended_fire_at, started_at, finished_at,
                          due_count, created_count, published_count)
SELECT $1::bigint + d, 'publish', 'ok', $2::timestamptz + d * interval '1 day',
       $2::timestamptz + d * interval '1 day', $2::timestamptz + d * interval '1 day 1 min',
       $3, $3, $3
FROM generate_series(0, $4 - 1) AS d
"""


async def seed(
    conn: asyncpg.Connection,
    *,
    first_id: int,
    count: int,
    start: datetime,
    end: datetime,
    queued_share: float = 0.0,
    content_purged: bool = False,
    label: str = "rows",
) -> float:
    """Insert ``count`` deliveries with ids from ``first_id``, occurrences evenly from
    ``start`` to ``end``, their attempts and one publish run per day; returns seconds.
    Advances the id sequences past what was inserted. ``content_purged``: as a daily purge
    leaves rows past the content period (no payload, no excerpts, ``content_purged_at``
    30 days after the end; needs migration 0018)."""
    purged = "true" if content_purged else "false"
    cols, vals = ("", "")
    if content_purged:
        cols, vals = (
            ", content_purged_at",
            ", CASE WHEN st <> 'queued' THEN occ + interval '30 d' END",
        )
    deliveries_sql = _DELIVERIES.format(cols=cols, vals=vals, purged=purged)
    attempts_sql = _ATTEMPTS.format(purged=purged)
    started = time.monotonic()
    step = (end - start).total_seconds() / max(count, 1)
    days = int((end - start).total_seconds() // 86400) + 1
    run_base = int(await conn.fetchval("SELECT coalesce(max(id), 0) + 1 FROM publish_runs"))
    per_day = count // max(days, 1) // 2
    await conn.execute(_RUNS, run_base, start, per_day, days)
    last = first_id + count - 1
    for lo in range(first_id, last + 1, BATCH):
        hi = min(lo + BATCH - 1, last)
        async with conn.transaction():
            await conn.execute(deliveries_sql, lo, hi, start, step, run_base, queued_share)
            await conn.execute(attempts_sql, lo, hi)
        done = hi - first_id + 1
        print(
            f"   seeding {label}: {done:,} of {count:,} deliveries "
            f"({time.monotonic() - started:.0f} s)",
            flush=True,
        )
    await conn.execute(
        "SELECT setval('deliveries_id_seq', (SELECT max(id) FROM deliveries)),"
        " setval('publish_runs_id_seq', (SELECT max(id) FROM publish_runs))"
    )
    return time.monotonic() - started


async def counts(conn: asyncpg.Connection, deliveries: str = "deliveries") -> tuple[int, int]:
    """(deliveries, attempts) rows; ``deliveries`` names the table pair's prefix."""
    attempts = "delivery_attempts" if deliveries == "deliveries" else f"{deliveries}_attempts"
    n = int(await conn.fetchval(f"SELECT count(*) FROM {deliveries}"))
    a = int(await conn.fetchval(f"SELECT count(*) FROM {attempts}"))
    return n, a


# ---------------------------------------------------------------- sizes and WAL


async def relation_sizes(conn: asyncpg.Connection, table: str) -> dict[str, int]:
    """heap (with TOAST), indexes and total bytes of a table; a partitioned table's
    figures are the sums over its partitions (its own relation has no storage)."""
    row = await conn.fetchrow(
        """
        SELECT coalesce(sum(pg_table_size(relid)), 0)::bigint AS heap,
               coalesce(sum(pg_indexes_size(relid)), 0)::bigint AS indexes,
               coalesce(sum(pg_total_relation_size(relid)), 0)::bigint AS total
        FROM (SELECT relid FROM pg_partition_tree($1::regclass)
              UNION SELECT $1::regclass) AS t
        """,
        table,
    )
    return {"heap": int(row["heap"]), "indexes": int(row["indexes"]), "total": int(row["total"])}


async def index_sizes(conn: asyncpg.Connection, table: str) -> dict[str, int]:
    """Bytes of each index of a (non-partitioned) table."""
    rows = await conn.fetch(
        "SELECT indexrelid::regclass::text AS name, pg_relation_size(indexrelid) AS bytes"
        " FROM pg_index WHERE indrelid = $1::regclass ORDER BY 1",
        table,
    )
    return {r["name"]: int(r["bytes"]) for r in rows}


async def dead_tuples(conn: asyncpg.Connection, table: str) -> tuple[int, int]:
    """(live, dead) tuples as the statistics collector counts them (this session's own
    changes flushed first)."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    row = await conn.fetchrow(
        "SELECT n_live_tup, n_dead_tup FROM pg_stat_user_tables WHERE relid = $1::regclass",
        table,
    )
    return (int(row["n_live_tup"]), int(row["n_dead_tup"])) if row else (0, 0)


async def pair_sizes(conn: asyncpg.Connection, pair: str) -> str:
    """Sizes of a deliveries table and its attempts (``deliveries`` or ``pdeliveries``)."""
    attempts = "delivery_attempts" if pair == "deliveries" else f"{pair}_attempts"
    parts = []
    for table in (pair, attempts):
        s = await relation_sizes(conn, table)
        parts.append(f"{table} {mb(s['total'])} (heap {mb(s['heap'])}, indexes {mb(s['indexes'])})")
    return "; ".join(parts)


async def tuples(conn: asyncpg.Connection) -> str:
    """Live and dead tuples of ``deliveries`` and ``delivery_attempts``."""
    out = []
    for table in ("deliveries", "delivery_attempts"):
        live, dead = await dead_tuples(conn, table)
        out.append(f"{table} {live:,} live / {dead:,} dead")
    return ", ".join(out)


async def bloat(conn: asyncpg.Connection, table: str) -> str:
    """Free space of the heap (pgstattuple_approx) and leaf density of each b-tree index
    (pgstatindex): what VACUUM made reusable but did not give back."""
    await conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
    heap = await conn.fetchrow(
        "SELECT approx_free_percent AS free, dead_tuple_percent AS dead"
        " FROM pgstattuple_approx($1::regclass)",
        table,
    )
    parts = [f"heap {heap['free']:.0f} % free, {heap['dead']:.0f} % dead tuples"]
    for name in await index_sizes(conn, table):
        density = await conn.fetchval(
            "SELECT avg_leaf_density FROM pgstatindex($1::regclass)", name
        )
        short = name.removeprefix(table + "_")
        empty = density != density  # NaN: an index with no leaf entries
        parts.append(f"{short} empty" if empty else f"{short} leaves {density:.0f} % full")
    return f"{table}: " + ", ".join(parts)


async def wal_lsn(conn: asyncpg.Connection) -> str:
    return str(await conn.fetchval("SELECT pg_current_wal_lsn()::text"))


async def wal_since(conn: asyncpg.Connection, lsn: str) -> int:
    """WAL bytes written by the whole server since ``lsn`` (everyone's, not only ours)."""
    sql = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)"
    return int(await conn.fetchval(sql, lsn))


def mb(n: float) -> str:
    return f"{n / 1048576:,.1f} MB"


# ---------------------------------------------------------------- plans


def node_types(plan: dict[str, Any]) -> list[str]:
    """The plan's node types, depth first ("Index Scan on deliveries_pkey", ...)."""
    label = str(plan.get("Node Type", "?"))
    if plan.get("Index Name"):
        label += f" using {plan['Index Name']}"
    elif plan.get("Relation Name"):
        label += f" on {plan['Relation Name']}"
    out = [label]
    for child in plan.get("Plans", []):
        out.extend(node_types(child))
    return out


async def plan_of(conn: asyncpg.Connection, sql: str, *args: object) -> list[str]:
    """EXPLAIN (FORMAT JSON) of a statement (not executed), as node types."""
    raw = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *args)
    doc = raw if isinstance(raw, list) else json.loads(raw)
    return node_types(doc[0]["Plan"])


# ---------------------------------------------------------------- activity


class Activity:
    """What each backend of one database is doing, sampled every ``interval`` s."""

    def __init__(self, url: str, interval: float = 0.1) -> None:
        self._url, self._interval = url, interval
        self.counts: dict[str, Counter[str]] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Activity:
        self._conn = await asyncpg.connect(self._url)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._conn.close()

    async def _run(self) -> None:
        while True:
            rows = await self._conn.fetch(
                "SELECT application_name AS app, state, wait_event_type AS wt, wait_event AS w"
                " FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )
            for r in rows:
                app = r["app"] or "other"
                if r["state"] == "active":
                    what = f"{r['wt']}:{r['w']}" if r["wt"] else "CPU"
                elif r["state"] == "idle in transaction":
                    what = "idle in transaction"
                else:
                    continue
                self.counts.setdefault(app, Counter())[what] += 1
            await asyncio.sleep(self._interval)

    def describe(self) -> str:
        parts = []
        for app, counter in sorted(self.counts.items()):
            total = sum(counter.values())
            top = ", ".join(f"{k} {v / total:.0%}" for k, v in counter.most_common(5))
            parts.append(f"{app} ({total} active samples): {top}")
        return "; ".join(parts) or "(no active backend sampled)"
