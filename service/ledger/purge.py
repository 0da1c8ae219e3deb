"""``relay purge``: remove what the retention policy no longer keeps, in short batches.

One call of ``purge`` is one run, in this order (each step in batches of ``batch_size``
rows, each batch its own short transaction that locks only the rows it changes, with
``SKIP LOCKED``, so the publisher and the consumers are never held up):

1. the audit trail past its period (run and destination actions, replays and drops,
   console reveals and ended sessions, closed pause windows, lifted suppressions, purge
   runs);
2. publish runs past their period that have no delivery and no run action left;
3. events past the webhook row period that no delivery names;
4. the content of final deliveries past their kind's content period (a dead one: the dead
   period): payload, an e-mail's or SMS's recipient, every reply excerpt (passing over
   those whose row step 5 deletes); then the payload of events past the webhook content
   period;
5. the rows of final deliveries past their kind's row period (a dead one: the dead row
   period), children first (attempts, receipts, reconciliations), their runs keeping the
   counts; a delivery whose receipt put an address on the suppression list stays while that
   suppression is kept.

Paced (``rows_per_second``: RELAY_RETENTION_PURGE_ROWS_PER_SECOND), a step sleeps after each
committed batch, holding no transaction and no row lock, until its rows so far over its time
so far are within the cap: a purge beside a drain takes a bounded share of the database's
CPU and WAL. And it gives way: while deliveries are due and not settled, each batch first
waits for them (a probe a second), up to ``yield_seconds`` in all per run
(RELAY_RETENTION_PURGE_YIELD_SECONDS), so a 06:00 wave drains as if no purge ran, and a
backlog that never clears cannot stop the purge (docs/benchmarks.md, "Purge under a
drain"). A dry run is neither paced nor waits.

A run or an event whose last delivery goes in step 5 goes in the next run: so a dry run,
which counts each step's candidates without changing anything, says what the run does.
Nothing that is not final is ever touched: every change re-checks, under its lock, what the
pick checked. Killed anywhere, a run leaves whole batches only; the next run carries on and
ends where an uninterrupted one would have (every step is idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import datetime

import asyncpg

from service import ledger
from service.crashpoints import CrashPoints
from service.db import q
from service.ledger.purge_batches import PurgeRun, batched, logged
from service.pacing import Pacer, Yielder
from service.progress import Progress
from service.retention import AUDIT_TABLES, DELIVERY_CHILDREN, Policy, PurgeSummary
from service.retention_settings import CHANNELS

# A failed run is recorded if its connection still answers; if not, the next run marks it.
_GONE = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError)


class PurgeBusy(Exception):
    """Another ``relay purge`` holds the lock: this one did nothing."""


async def purge(
    pool: asyncpg.Pool,
    policy: Policy,
    as_of: datetime,
    *,
    batch_size: int = 5000,
    rows_per_second: int = 0,
    yield_seconds: float = 0,
    dry_run: bool = False,
    progress: Progress | None = None,
    crashpoints: CrashPoints | None = None,
    host: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> PurgeSummary:
    """Purge (``dry_run``: count) what ``policy`` no longer keeps as of ``as_of``.

    Applied, the run is recorded in ``purge_runs`` (its policy and cap, counts, status) and
    the totals behind ``relay_purge_rows_total`` grow batch by batch. ``rows_per_second``
    caps each step's rate (0: unpaced; a dry run never is), timed by ``clock`` and waited
    out by ``sleep`` (a test's own); while deliveries are due, each batch first waits for
    them, up to ``yield_seconds`` in all (0: never; a dry run never does). Raises
    ``PurgeBusy`` if another purge is running; a dry run takes no lock and writes nothing.
    """
    cap, bound = (0, 0) if dry_run else (rows_per_second, yield_seconds)
    recorded = policy.as_dict() | {"rows_per_second": cap, "yield_seconds": bound}
    summary = PurgeSummary(dry_run, as_of, recorded, cap, yield_seconds=int(bound))
    async with pool.acquire() as conn:
        if not dry_run and not await conn.fetchval(q("purge_lock")):
            raise PurgeBusy("another relay purge is running: this one did nothing")
        run = PurgeRun(
            conn, summary, policy.cutoffs(as_of), batch_size, progress,
            crashpoints or CrashPoints(), Pacer(cap, clock=clock, sleep=sleep),
            Yielder(bound, lambda: run.due_work(), sleep=sleep),
        )  # fmt: skip
        try:
            if not dry_run:
                await conn.execute(q("purge_runs_interrupted"))
                summary.run_id = await conn.fetchval(
                    q("purge_run_start"), as_of, summary.policy, host or socket.gethostname()
                )
            await _steps(run)
            summary.status = "ok"
        except Exception as exc:
            summary.status = "failed"
            await _finish(conn, summary, type(exc).__name__)
            raise
        finally:
            if progress is not None:
                progress.finish()
            if not dry_run:
                await _unlock(conn)
        await _finish(conn, summary, None)
    return summary


async def _finish(conn: ledger.Connection, summary: PurgeSummary, error: str | None) -> None:
    """Record the run's end; a connection already gone leaves it 'running' (the next run
    marks it interrupted)."""
    if summary.run_id is None:
        return
    with contextlib.suppress(*_GONE):
        await conn.execute(q("purge_run_finish"), summary.run_id, summary.status, error)


async def _unlock(conn: ledger.Connection) -> None:
    # The lock is the session's: a pooled connection must not keep it for the next user.
    with contextlib.suppress(*_GONE):
        await conn.execute(q("purge_unlock"))


async def _steps(run: PurgeRun) -> None:
    await _audit(run)
    await _runs(run)
    await _events(run)
    for channel in CHANNELS:
        await _delivery_content(run, channel)
    await _event_content(run)
    rows_horizon = run.cutoffs.rows_horizon()
    if rows_horizon is not None and not run.dry:
        # Recorded before the first row goes: a backfill never re-admits a purged occurrence.
        await run.conn.execute(q("purge_horizon_rows"), rows_horizon)
    for channel in CHANNELS:
        await _delivery_rows(run, channel)


async def _audit(run: PurgeRun) -> None:
    cutoff = run.cutoffs.audit
    if cutoff is None:
        return
    if run.dry:
        row = await run.conn.fetchrow(q("purge_audit_count"), cutoff)
        assert row is not None
        await run.record([(t, "rows", row[t]) for t in AUDIT_TABLES])
        logged(run, "audit", {f"{t}/rows": row[t] for t in AUDIT_TABLES})
        return
    done: dict[str, int] = {}
    run.pacer.restart()
    for table in AUDIT_TABLES:
        while True:
            await run.give_way()
            async with run.conn.transaction():
                gone = await run.conn.fetch(_audit_delete(table), cutoff, run.batch_size)
                await run.record([(table, "rows", len(gone))])
            await run.paced(len(gone))
            done[f"{table}/rows"] = done.get(f"{table}/rows", 0) + len(gone)
            if len(gone) < run.batch_size:
                break
    logged(run, "audit", done)


def _audit_delete(table: str) -> str:
    """The statement that deletes one batch of ``table``'s audit records past the cutoff."""
    return {
        "run_actions": q("purge_audit_run_actions"),
        "destination_actions": q("purge_audit_destination_actions"),
        "replays": q("purge_audit_replays"),
        "console_reveals": q("purge_audit_console_reveals"),
        "console_sessions": q("purge_audit_console_sessions"),
        "admission_pauses": q("purge_audit_admission_pauses"),
        "suppressions": q("purge_audit_suppressions"),
        "purge_runs": q("purge_audit_purge_runs"),
    }[table]


async def _runs(run: PurgeRun) -> None:
    cutoff = run.cutoffs.runs
    if cutoff is None:
        return

    async def pick(at: datetime, after: int) -> list[asyncpg.Record]:
        return await run.conn.fetch(
            q("purge_runs_pick"), cutoff, at, after, run.cutoffs.audit, run.batch_size
        )

    async def change(ids: list[int]) -> list[tuple[str, str, int]]:
        gone = await run.conn.fetch(q("purge_runs_delete"), ids, cutoff)
        return [("publish_runs", "rows", len(gone))]

    async def count(ids: list[int]) -> list[tuple[str, str, int]]:
        return [("publish_runs", "rows", len(ids))]

    await batched(run, "publish_runs", pick, change, count)


async def _events(run: PurgeRun) -> None:
    cutoff = run.cutoffs.events_rows
    if cutoff is None:
        return

    async def pick(at: datetime, after: int) -> list[asyncpg.Record]:
        return await run.conn.fetch(q("purge_events_pick"), cutoff, at, after, run.batch_size)

    async def change(ids: list[int]) -> list[tuple[str, str, int]]:
        return [
            ("events", "rows", len(await run.conn.fetch(q("purge_events_delete"), ids, cutoff)))
        ]

    async def count(ids: list[int]) -> list[tuple[str, str, int]]:
        return [("events", "rows", len(ids))]

    await batched(run, "events", pick, change, count)


async def _delivery_content(run: PurgeRun, channel: str) -> None:
    cutoff, dead = run.cutoffs.content[channel], run.cutoffs.dead_content
    if cutoff is None:
        return

    async def pick(at: datetime, after: int) -> list[asyncpg.Record]:
        c = run.cutoffs  # with the row cutoffs: a row step 5 deletes comes back passed_over
        return await run.conn.fetch(
            q("purge_content_pick"), channel, cutoff, dead, at, after, run.batch_size,
            c.rows[channel], c.dead_rows, c.audit,
        )  # fmt: skip

    async def change(ids: list[int]) -> list[tuple[str, str, int]]:
        row = await run.conn.fetchrow(q("purge_content_apply"), ids, cutoff, dead)
        assert row is not None
        run.summary.add_channel("content", channel, row["deliveries"])
        return [
            ("deliveries", "content", row["deliveries"]),
            ("delivery_attempts", "content", row["excerpts"]),
        ]

    async def count(ids: list[int]) -> list[tuple[str, str, int]]:
        excerpts = await run.conn.fetchval(q("purge_content_excerpts"), ids)
        run.summary.add_channel("content", channel, len(ids))
        return [("deliveries", "content", len(ids)), ("delivery_attempts", "content", excerpts)]

    await batched(run, f"deliveries content ({channel})", pick, change, count)


async def _event_content(run: PurgeRun) -> None:
    cutoff = run.cutoffs.events_content
    if cutoff is None:
        return
    if not run.dry:
        await run.conn.execute(q("purge_horizon_event_content"), cutoff)

    async def pick(at: datetime, after: int) -> list[asyncpg.Record]:
        return await run.conn.fetch(
            q("purge_event_content_pick"), cutoff, at, after, run.batch_size
        )

    async def change(ids: list[int]) -> list[tuple[str, str, int]]:
        gone = await run.conn.fetch(q("purge_event_content_apply"), ids, cutoff)
        return [("events", "content", len(gone))]

    async def count(ids: list[int]) -> list[tuple[str, str, int]]:
        return [("events", "content", len(ids))]

    await batched(run, "events content", pick, change, count)


async def _delivery_rows(run: PurgeRun, channel: str) -> None:
    cutoff, dead, audit = run.cutoffs.rows[channel], run.cutoffs.dead_rows, run.cutoffs.audit
    if cutoff is None:
        return

    async def pick(at: datetime, after: int) -> list[asyncpg.Record]:
        return await run.conn.fetch(
            q("purge_rows_pick"), channel, cutoff, dead, at, after, audit, run.batch_size
        )

    async def change(ids: list[int]) -> list[tuple[str, str, int]]:
        locked = [
            r["id"] for r in await run.conn.fetch(q("purge_rows_lock"), ids, cutoff, dead, audit)
        ]
        children = await run.conn.fetchrow(q("purge_rows_children"), locked)
        assert children is not None
        # Killed here, the transaction rolls back: children and parents go together or not.
        run.crash.hit("purge_inside_batch")
        await run.conn.execute(q("purge_rows_run_counts"), locked)
        gone = await run.conn.fetch(q("purge_rows_delete"), locked)
        run.summary.add_channel("rows", channel, len(gone))
        return [("deliveries", "rows", len(gone))] + [
            (t, "rows", children[t]) for t in DELIVERY_CHILDREN
        ]

    async def count(ids: list[int]) -> list[tuple[str, str, int]]:
        children = await run.conn.fetchrow(q("purge_rows_children_count"), ids)
        assert children is not None
        run.summary.add_channel("rows", channel, len(ids))
        return [("deliveries", "rows", len(ids))] + [
            (t, "rows", children[t]) for t in DELIVERY_CHILDREN
        ]

    # A crash point after each committed batch: killed there, the next run carries on.
    await batched(run, f"deliveries rows ({channel})", pick, change, count, "purge_after_batch")
