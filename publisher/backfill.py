"""``relay backfill``: admit, on purpose, the occurrences of a window the ledger lacks.

For one reminder (or every active one) and a window ``[from, to]`` (``to`` at most now),
each occurrence its schedule has there is looked up by its idempotency key:

- no row: inserted ``pending`` as a row of a new run of kind ``backfill``;
- a row skipped because admission was paused (reason ``paused``): reopened ``pending``
  in that run (the operator decided it is owed after all);
- any other row (sent, owed, dead, skipped for another reason): left as it is.

So running it twice creates nothing the second time. A dry run (the default) counts the
same without writing. The rows are published by the next ``relay publish`` (its pending
sweep) or at once with ``--publish``. The missed-fire policy is not consulted: it governs
a publisher that was down, and a backfill is an operator's explicit choice.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from service import admission, amqp, control, db, errors, ledger, runs, schedule
from service.admission import NewDelivery
from service.ledger import State
from service.progress import Progress
from service.settings import Settings

# Most occurrences one reminder may backfill in one command (a window too wide is refused).
MAX_PER_REMINDER = 10_000
_CLOSE_SECONDS = 5.0


@dataclass
class BackfillSummary:
    apply: bool
    start: datetime
    end: datetime
    reminders: int = 0
    in_window: int = 0  # occurrences the schedules have in the window
    already: int = 0  # of those, rows the ledger has (left alone)
    new: int = 0  # inserted (dry run: would be)
    reopened: int = 0  # skipped 'paused' -> pending (dry run: would be)
    published: int = 0
    failed: int = 0  # not confirmed by the broker (left pending for relay publish)
    run_id: int | None = None  # the backfill run, once something was admitted
    ready: list[tuple[int, bool, datetime]] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        del data["ready"]
        return data

    def render(self) -> str:
        verb = "admitted" if self.apply else "would admit"
        text = (
            f"backfill {self.start:%Y-%m-%d %H:%M:%S}..{self.end:%Y-%m-%d %H:%M:%S} UTC: "
            f"reminders={self.reminders} in_window={self.in_window} already={self.already} "
            f"{verb}={self.new + self.reopened} (new {self.new}, reopened paused "
            f"{self.reopened})"
        )
        if self.run_id is not None:
            text += f" run={self.run_id} published={self.published} failed={self.failed}"
        elif self.apply:
            text += " (nothing to admit: no run recorded)"
        if not self.apply:
            text += "\n  dry run: nothing changed; add --apply to do it"
        elif self.published == 0 and self.new + self.reopened:
            text += "\n  the next relay publish sends them (or use --publish)"
        return text


def _owed(row: asyncpg.Record, start: datetime, end: datetime) -> list[NewDelivery]:
    found = schedule.occurrences(schedule.from_row(row), start, end, MAX_PER_REMINDER + 1)
    if len(found) > MAX_PER_REMINDER:
        raise errors.InputError(
            f"reminder {row['id']}: more than {MAX_PER_REMINDER} occurrences in the window; "
            "backfill a narrower one"
        )
    return [NewDelivery.of(row, at) for at in found]


async def _one(pool: asyncpg.Pool, row: asyncpg.Record, summary: BackfillSummary) -> None:
    owed = _owed(row, summary.start, summary.end)
    if not owed:
        return
    summary.in_window += len(owed)
    have = await control.existing_keys(pool, [o.key for o in owed])
    missing = [o for o in owed if o.key not in have]
    paused = [k for k, (state, why) in have.items() if state is State.SKIPPED and why == "paused"]
    summary.already += len(have) - len(paused)
    if not summary.apply:
        summary.new += len(missing)
        summary.reopened += len(paused)
        return
    if not missing and not paused:
        return
    if summary.run_id is None:  # the first occurrence to admit opens the backfill run
        started = await runs.start(pool, "backfill", summary.start, socket.gethostname())
        summary.run_id = started.run_id
    async with pool.acquire() as conn, conn.transaction():
        inserted = await admission.insert_deliveries(conn, missing, summary.run_id)
        reopened = await control.reopen_paused(conn, paused, summary.run_id)
    summary.new += len(inserted)
    summary.reopened += len(reopened)
    summary.already += len(missing) - len(inserted) + len(paused) - len(reopened)
    summary.ready += [(i.id, i.urgent, i.occurrence_at) for i in inserted] + reopened


async def admit(
    pool: asyncpg.Pool, reminder_id: str | None, start: datetime, end: datetime, *, apply: bool
) -> BackfillSummary:
    """Count (or, ``apply``, admit) the window's occurrences the ledger lacks."""
    now = await pool.fetchval(db.q("db_now"))
    summary = BackfillSummary(apply, start, min(end, now))
    rows = await pool.fetch(db.q("backfill_reminders"), reminder_id)
    if reminder_id is not None and not rows:
        raise errors.InputError(f"--reminder: no reminder {reminder_id!r}")
    progress = Progress("backfill")
    try:
        for row in rows:
            await _one(pool, row, summary)
            summary.reminders += 1
            progress.update(summary.reminders, len(rows))
    finally:
        progress.finish()
        if summary.run_id is not None:
            await _finish(pool, summary)
    return summary


async def _finish(pool: asyncpg.Pool, summary: BackfillSummary) -> None:
    assert summary.run_id is not None
    await runs.finish(
        pool,
        summary.run_id,
        "ok" if summary.failed == 0 else "incomplete",
        due=summary.in_window,
        created=summary.new + summary.reopened,
        skipped=0,
        published=summary.published,
        rescued=0,
        failed=summary.failed,
        error=None,
    )


async def publish(settings: Settings, pool: asyncpg.Pool, summary: BackfillSummary) -> None:
    """Publish the admitted rows now (through the timer when not due yet)."""
    if not summary.ready:
        return
    connection, publisher = await amqp.open_publisher(settings, "relay-backfill")
    try:
        now = await pool.fetchval(db.q("db_now"))
        items = [(i, urgent, (at - now).total_seconds()) for i, urgent, at in summary.ready]
        confirmed, failed = await publisher.publish_many(items)
        await ledger.mark_queued(pool, confirmed)
    finally:
        await amqp.close_connection(connection, _CLOSE_SECONDS)
    summary.published, summary.failed = len(confirmed), len(failed)


async def run(
    settings: Settings,
    *,
    reminder_id: str | None,
    start: datetime,
    end: datetime,
    apply: bool,
    publish_now: bool,
) -> BackfillSummary:
    """Composition root of ``relay backfill``."""
    async with contextlib.AsyncExitStack() as stack:
        pool = await db.create_pool(settings, size=2)
        stack.push_async_callback(db.close_pool, pool, _CLOSE_SECONDS)
        summary = await admit(pool, reminder_id, start, end, apply=apply)
        if apply and publish_now:
            await publish(settings, pool, summary)
            assert summary.run_id is not None
            await runs.record_published(pool, summary.run_id, summary.published, summary.failed)
        return summary
    raise AssertionError("unreachable")
