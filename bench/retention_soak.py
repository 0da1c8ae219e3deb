"""Retention soak: a simulated year of admitting, delivering and purging; do the tables and
indexes stay bounded, and do the hot queries keep their plans (issue 27, item 4)?

One database (``relay_bench_soak_*``: ``CREATE DATABASE`` + ``relay migrate``, dropped at
the end). Each simulated day (default 365 days, 1,000 deliveries a day):

1. admit the day's deliveries and take them through the real transitions with set-based
   SQL, one statement per step for the whole day (the consumer's statements stamp the real
   clock, the simulation needs the simulated one): insert ``pending`` (half schedule rows
   of that day's publish run, half outbox webhooks with a JSON payload), ``queued`` (2 %
   ``skipped`` stale instead), ``sending``; half fail once (an attempt row, ``retrying``,
   ``sending`` again); then ``delivered`` with an attempt row (1 % ``dead``). Each row
   leaves the same versions behind as in production, not just one insert;
2. run the real purge (``service.ledger.purge.purge``) as of the end of that day, with a policy in
   days (default: content 30, rows 90, dead content 90, dead rows 120, runs and audit 120);
3. do what autovacuum would with its default thresholds (VACUUM a table when its dead
   tuples pass 50 + 20 % of its rows or its inserts since the last vacuum pass 1,000 + 20 %;
   ANALYZE when changes pass 50 + 10 %): the shared server this was written on runs with
   ``autovacuum = off``; ``--vacuum none`` shows what happens then.

Every simulated week: ``pg_total_relation_size`` and the index sizes of ``deliveries`` and
``delivery_attempts``. At the start (day 7), when the longest row period has passed
(steady state) and at the end: ``EXPLAIN (FORMAT JSON)`` of the hot queries (the claim and
the outcome write, the publish page, the status report's queries, the purge's own pick),
compared by node types. Printed: the size series; bounded or not (growth from the first
steady week to the end); plans changed or not.

    .venv/bin/python bench/retention_soak.py                      # 365 days x 1,000
    .venv/bin/python bench/retention_soak.py --per-day 2000       # twice the rows
    .venv/bin/python bench/retention_soak.py --vacuum-scale 0.05  # vacuum sooner
    .venv/bin/python bench/retention_soak.py --days 120 --per-day 500   # a quick look
    .venv/bin/python bench/retention_soak.py --vacuum none        # autovacuum off
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _retention as ret
import _soak_plans as plans
import asyncpg
from _common import bench_env, load_average

from service import db
from service.ledger.purge import purge
from service.retention import Policy
from service.retention_settings import CHANNELS
from service.settings import Settings

SIM_START = datetime(2025, 12, 1, tzinfo=UTC)

# $1 first id, $2 last id, $3 the day's start, $4 the day's publish run
_ADMIT = """
INSERT INTO deliveries (id, idempotency_key, reminder_id, source, channel, destination,
                        payload, occurrence_at, run_id, created_at)
SELECT i, md5(i::text) || ':' || i,
    CASE WHEN i % 2 = 0 THEN 'rem-' || (i % 50000) END,
    CASE WHEN i % 2 = 0 THEN 'schedule' ELSE 'outbox' END, 'webhook',
    CASE WHEN i % 2 = 1 THEN 'https://partner-' || (i % 20) || '.example.org/hooks/r' END,
    CASE WHEN i % 2 = 1 THEN jsonb_build_object('text',
        'Your appointment is tomorrow at 09:30. Reply STOP to cancel.', 'n', i) END,
    occ, CASE WHEN i % 2 = 0 THEN $4::bigint END, occ - interval '60 s'
FROM (SELECT i, $3::timestamptz + (i - $1) * (interval '1 day' / ($2 - $1 + 1)) AS occ
      FROM generate_series($1::bigint, $2::bigint) AS i) AS s
"""
_STEPS = (
    # publish: queued, or skipped as stale
    """UPDATE deliveries SET
        state = (CASE WHEN id % 50 = 2 THEN 'skipped' ELSE 'queued' END)::delivery_state,
        skip_reason = CASE WHEN id % 50 = 2 THEN 'stale' END,
        finished_at = CASE WHEN id % 50 = 2 THEN occurrence_at END,
        published_at = occurrence_at - interval '10 s'
       WHERE id BETWEEN $1 AND $2 AND state = 'pending'""",
    # claim
    """UPDATE deliveries SET state = 'sending', attempts = attempts + 1,
        lease_expires_at = occurrence_at + interval '5 min', next_attempt_at = NULL,
        first_attempt_at = coalesce(first_attempt_at, occurrence_at),
        last_check_at = occurrence_at
       WHERE id BETWEEN $1 AND $2 AND state IN ('queued', 'retrying')""",
    # half fail once: an attempt row, retrying
    """WITH failed AS (
        UPDATE deliveries SET state = 'retrying', lease_expires_at = NULL,
            last_check_at = NULL, next_attempt_at = occurrence_at + interval '30 s',
            last_status = 503, last_error = 'HTTP 503'
        WHERE id BETWEEN $1 AND $2 AND state = 'sending' AND attempts = 1
          AND ((id / 2) % 2 = 1 OR id % 100 = 3)
        RETURNING id, attempts, occurrence_at)
       INSERT INTO delivery_attempts (delivery_id, attempt, outcome, http_status, latency_ms,
                                      response_excerpt, started_at, finished_at)
       SELECT id, attempts, 'retry', 503, 40, 'Service Unavailable: try again later',
              occurrence_at, occurrence_at + interval '40 ms' FROM failed""",
    # claim again
    """UPDATE deliveries SET state = 'sending', attempts = attempts + 1,
        lease_expires_at = occurrence_at + interval '5 min', next_attempt_at = NULL,
        last_check_at = occurrence_at + interval '30 s'
       WHERE id BETWEEN $1 AND $2 AND state = 'retrying'""",
    # the outcome: delivered (dead: 1 %), with its attempt row
    """WITH done AS (
        UPDATE deliveries SET
            state = (CASE WHEN id % 100 = 3 THEN 'dead' ELSE 'delivered' END)::delivery_state,
            lease_expires_at = NULL, last_check_at = NULL,
            last_status = CASE WHEN id % 100 = 3 THEN 500 ELSE 200 END,
            last_error = CASE WHEN id % 100 = 3 THEN 'HTTP 500 from the partner' END,
            finished_at = occurrence_at + attempts * interval '200 ms'
        WHERE id BETWEEN $1 AND $2 AND state = 'sending'
        RETURNING id, attempts, state, occurrence_at)
       INSERT INTO delivery_attempts (delivery_id, attempt, outcome, http_status, latency_ms,
                                      response_excerpt, started_at, finished_at)
       SELECT id, attempts, CASE WHEN state = 'dead' THEN 'rejected' ELSE 'accepted' END,
              CASE WHEN state = 'dead' THEN 500 ELSE 200 END, 60,
              '{"ok":true,"id":"msg_' || id || '"}', occurrence_at,
              occurrence_at + interval '60 ms' FROM done""",
)
_RUN = """
INSERT INTO publish_runs (kind, status, intended_fire_at, started_at, finished_at, due_count,
                          created_count, published_count)
VALUES ('publish', 'ok', $1::timestamptz, $1::timestamptz, $1::timestamptz + interval '1 min',
        $2, $2, $2)
RETURNING id
"""
TABLES = ("deliveries", "delivery_attempts")


async def simulate_day(conn: asyncpg.Connection, day: int, per_day: int) -> tuple[int, int]:
    """One day's deliveries, admitted and taken to their outcome; returns their id range."""
    start = SIM_START + timedelta(days=day)
    run_id = await conn.fetchval(_RUN, start, per_day // 2)
    lo = int(await conn.fetchval("SELECT nextval('deliveries_id_seq')"))
    hi = lo + per_day - 1
    await conn.execute("SELECT setval('deliveries_id_seq', $1)", hi)
    await conn.execute(_ADMIT, lo, hi, start, run_id)
    for step in _STEPS:
        await conn.execute(step, lo, hi)
    return lo, hi


async def _flush_stats(pool: asyncpg.Pool) -> None:
    """Make the purge's connections report their deletes now: a backend otherwise sends its
    counts up to 10 s later, which is many simulated days, and the autovacuum emulation
    would see too few dead tuples (and vacuum later, the busier the host)."""
    conns = [await pool.acquire() for _ in range(pool.get_size())]
    try:
        for conn in conns:
            await conn.execute("SELECT pg_stat_force_next_flush()")
            await conn.execute("SELECT 1")
    finally:
        for conn in conns:
            await pool.release(conn)


async def autovacuum(conn: asyncpg.Connection, scale: float = 0.2) -> list[str]:
    """VACUUM / ANALYZE each table past autovacuum's thresholds (``scale``: its vacuum and
    insert scale factors, 0.2 by default; analyze's is half of it); what was done."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    done = []
    for table in (*TABLES, "publish_runs"):
        row = await conn.fetchrow(
            "SELECT s.n_dead_tup AS dead, s.n_ins_since_vacuum AS ins,"
            " s.n_mod_since_analyze AS mods, greatest(c.reltuples, 0) AS n"
            " FROM pg_stat_user_tables AS s JOIN pg_class AS c ON c.oid = s.relid"
            " WHERE s.relid = $1::regclass",
            table,
        )
        vacuum = row["dead"] > 50 + scale * row["n"] or row["ins"] > 1000 + scale * row["n"]
        analyze = row["mods"] > 50 + scale / 2 * row["n"]
        what = "VACUUM (ANALYZE)" if vacuum and analyze else "VACUUM" if vacuum else "ANALYZE"
        if vacuum or analyze:
            await conn.execute(f"{what} {table}")
            done.append(f"{what} {table}")
    return done


async def sizes(conn: asyncpg.Connection) -> dict[str, int]:
    """Rows, heap and index bytes of each table, and each index's bytes ("idx:" + name)."""
    out: dict[str, int] = {}
    for table in TABLES:
        s = await ret.relation_sizes(conn, table)
        out[f"{table}.heap"], out[f"{table}.indexes"] = s["heap"], s["indexes"]
        out[f"{table}.rows"] = int(await conn.fetchval(f"SELECT count(*) FROM {table}"))
        for name, size in (await ret.index_sizes(conn, table)).items():
            out[f"idx:{name}"] = size
    return out


def _total(s: dict[str, int]) -> int:
    return sum(v for k, v in s.items() if k.endswith((".heap", ".indexes")))


def policy(args: argparse.Namespace) -> Policy:
    return Policy(
        content_days=dict.fromkeys(CHANNELS, args.content_days),
        rows_days=dict.fromkeys(CHANNELS, args.rows_days),
        dead_content_days=args.dead_content_days,
        dead_rows_days=args.dead_rows_days,
        runs_days=args.runs_days,
        audit_days=args.runs_days,
    )


def _week_line(day: int, s: dict[str, int], purged: int, vacuums: int) -> str:
    d, a = "deliveries", "delivery_attempts"
    total = _total(s)
    return (
        f"day {day:3d}: deliveries {s[d + '.rows']:7,} rows, heap {ret.mb(s[d + '.heap']):>9}, "
        f"indexes {ret.mb(s[d + '.indexes']):>9} | attempts {s[a + '.rows']:7,} rows, heap "
        f"{ret.mb(s[a + '.heap']):>9}, indexes {ret.mb(s[a + '.indexes']):>9} | total "
        f"{ret.mb(total):>9} | purged so far {purged:,} deliveries, {vacuums} VACUUMs"
    )


def _bounded(series: list[tuple[int, dict[str, int]]], steady_day: int) -> str:
    """Growth of the total size from the first steady week to the end, and over the last
    100 days: bounded when both are small (< 10 %, < 3 %)."""
    steady = [(day, s) for day, s in series if day >= steady_day]
    if len(steady) < 3 or steady[-1][0] - steady[0][0] < 100:
        return f"too short to judge: the steady state starts on day {steady_day}"
    (first_day, first), (last_day, last) = steady[0], steady[-1]
    late_day, late = next((d, s) for d, s in steady if d >= last_day - 100)
    growth, late_growth = _total(last) / _total(first) - 1, _total(last) / _total(late) - 1
    verdict = "BOUNDED" if growth < 0.10 and late_growth < 0.03 else "NOT BOUNDED (growing)"
    parts = [
        f"{k} {last[k] / first[k] - 1:+.0%}"
        for k in first
        if k.endswith((".heap", ".indexes")) and first[k]
    ]
    return (
        f"{verdict}: total size day {first_day} {ret.mb(_total(first))} -> day {last_day} "
        f"{ret.mb(_total(last))} ({growth:+.1%}; over the last 100 days, from day {late_day}: "
        f"{late_growth:+.1%}); by part: {', '.join(parts)}"
    )


def _index_report(series: list[tuple[int, dict[str, int]]], steady_day: int) -> None:
    """Each index's size at the steady state's start, its middle and the end."""
    steady = [(day, s) for day, s in series if day >= steady_day]
    if len(steady) < 3:
        return
    (d0, s0), (d1, s1), (d2, s2) = steady[0], steady[len(steady) // 2], steady[-1]
    names = sorted((k for k in s2 if k.startswith("idx:") and s2[k]), key=lambda k: -s2[k])
    print(f"indexes on days {d0} / {d1} / {d2}:")
    for k in names:
        print(
            f"   {k[4:]}: {ret.mb(s0.get(k, 0))} / {ret.mb(s1.get(k, 0))} / {ret.mb(s2[k])}"
            + (f" ({s2[k] / s0[k] - 1:+.0%})" if s0.get(k) else "")
        )


async def _plans(
    conn: asyncpg.Connection, lo: int, hi: int, day: int, args: argparse.Namespace
) -> dict[str, list[str]]:
    run_id = int(await conn.fetchval("SELECT max(id) FROM publish_runs"))
    ids = list(range(max(lo, hi - 199), hi + 1))
    as_of = SIM_START + timedelta(days=day + 1)
    return await plans.capture(conn, ids, run_id, as_of, args.rows_days)


async def soak(args: argparse.Namespace, url: str) -> None:
    pool = await db.create_pool(Settings(database_url=url), size=2)
    conn = await asyncpg.connect(url)
    try:
        steady_day = max(args.rows_days, args.dead_rows_days, args.runs_days) + 7
        marks = {7: "start", steady_day: "steady", args.days: "end"}
        series: list[tuple[int, dict[str, int]]] = []
        captured: dict[str, dict[str, list[str]]] = {}
        timings, purged, vacuums = {"admit": 0.0, "purge": 0.0, "vacuum": 0.0}, 0, 0
        for day in range(args.days):
            t = time.monotonic()
            lo, hi = await simulate_day(conn, day, args.per_day)
            timings["admit"] += time.monotonic() - t
            t = time.monotonic()
            summary = await purge(pool, policy(args), SIM_START + timedelta(days=day + 1))
            await _flush_stats(pool)
            timings["purge"] += time.monotonic() - t
            purged += summary.rows.get("deliveries", 0)
            if args.vacuum == "auto":
                t = time.monotonic()
                done = await autovacuum(conn, args.vacuum_scale)
                vacuums += sum(w.startswith("VACUUM") for w in done)
                timings["vacuum"] += time.monotonic() - t
            if (day + 1) % 7 == 0 or day + 1 == args.days:
                series.append((day + 1, await sizes(conn)))
                print(_week_line(day + 1, series[-1][1], purged, vacuums), flush=True)
            if day + 1 in marks:
                captured[marks[day + 1]] = await _plans(conn, lo, hi, day, args)
        _report(series, captured, steady_day, timings, {v: k for k, v in marks.items()})
        _index_report(series, steady_day)
    finally:
        await conn.close()
        await pool.close()


def _report(
    series: list[tuple[int, dict[str, int]]],
    captured: dict[str, dict[str, list[str]]],
    steady_day: int,
    timings: dict[str, float],
    days: dict[str, int],
) -> None:
    print(
        "time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + "\n"
        f"size: {_bounded(series, steady_day)}"
    )
    for before, after in (("steady", "end"), ("start", "end")):
        if before in captured and "end" in captured:
            print(f"plans, {before} (day {days[before]}) vs end (day {days['end']}):")
            print("\n".join(plans.compare(captured[before], captured[after])))


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--days", type=int, default=365, help="simulated days (365)")
    parser.add_argument("--per-day", type=int, default=1000, help="deliveries a day (1000)")
    parser.add_argument("--content-days", type=int, default=30)
    parser.add_argument("--rows-days", type=int, default=90)
    parser.add_argument("--dead-content-days", type=int, default=90)
    parser.add_argument("--dead-rows-days", type=int, default=120)
    parser.add_argument("--runs-days", type=int, default=120, help="runs and audit trail")
    parser.add_argument("--vacuum", choices=("auto", "none"), default="auto")
    parser.add_argument(
        "--vacuum-scale",
        type=float,
        default=0.2,
        help="autovacuum_vacuum_scale_factor (and insert's) of the emulation (0.2)",
    )
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    print(
        f"== retention soak: {args.days} days x {args.per_day:,} deliveries; content "
        f"{args.content_days} d, rows {args.rows_days} d, dead {args.dead_content_days}/"
        f"{args.dead_rows_days} d, runs and audit {args.runs_days} d; vacuum {args.vacuum} "
        f"(scale factor {args.vacuum_scale}); "
        f"load average {load_average()}; {os.cpu_count()} CPUs",
        flush=True,
    )
    started = time.monotonic()
    async with bench_env("soak", keep_scratch=args.keep_logs) as env:
        await soak(args, env.database_url)
    print(f"wall {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    asyncio.run(main())
