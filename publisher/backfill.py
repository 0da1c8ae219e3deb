"""``relay backfill``: admit, on purpose, the occurrences of a window the ledger lacks.

For one reminder (or every active one) and a window ``[from, to]`` (``to`` at most now),
each occurrence the reminder owed there *as it was then* -- piecewise over its schedule
history (``service.schedule_history``: before an edit the old schedule's occurrences,
after it the new one's) -- is looked up by its idempotency key:

- no row: inserted ``pending`` as a row of a new run of kind ``backfill``;
- a row skipped because admission was paused (reason ``paused``): reopened ``pending``
  in that run (the operator decided it is owed after all);
- any other row (sent, owed, dead, skipped for another reason): left as it is.

So running it twice creates nothing the second time. A dry run (the default) counts and
lists the occurrences it would admit without writing; applied, it lists those it admitted.
The rows are published by the next ``relay publish`` (its pending sweep) or at once with
``--publish``. The missed-fire policy is not consulted: it governs a publisher that was
down, and a backfill is an operator's explicit choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg

from service import amqp, db, errors, publishing, retention, schedule, schedule_history, signals
from service.ledger import State, admission, control, publication, publish_runs
from service.ledger.admission import NewDelivery
from service.progress import Progress
from service.settings import Settings

# Most occurrences one reminder may backfill in one command (a window too wide is refused).
MAX_PER_REMINDER = 10_000
_CLOSE_SECONDS = 5.0


@dataclass(frozen=True)
class Listed:
    """One occurrence a backfill admits (or, in a dry run, would admit)."""

    reminder_id: str
    occurrence_at: datetime  # UTC
    timezone: str  # of the schedule that owed it
    channel: str
    action: str  # new (inserted) | reopen (skipped 'paused' -> pending)

    def local(self) -> datetime:
        return self.occurrence_at.astimezone(ZoneInfo(self.timezone))

    def as_dict(self) -> dict[str, Any]:
        return {
            "reminder_id": self.reminder_id,
            "occurrence_at": self.occurrence_at.isoformat(),
            "local": self.local().isoformat(),
            "timezone": self.timezone,
            "channel": self.channel,
            "action": self.action,
        }

    def render(self) -> str:
        utc = self.occurrence_at.astimezone(UTC)
        local = self.local().isoformat(sep=" ", timespec="seconds")
        return (
            f"{self.reminder_id} {utc:%Y-%m-%dT%H:%M:%SZ} (local {local} {self.timezone}) "
            f"{self.channel} {self.action}"
        )


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
    listed: list[Listed] = field(default_factory=list)  # admitted (dry run: would be)
    ready: list[tuple[int, bool, datetime]] = field(default_factory=list, repr=False)
    interrupted: bool = False  # stopped by SIGTERM or SIGINT before it finished

    def as_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        del data["ready"], data["listed"]
        data["occurrences"] = [item.as_dict() for item in self.listed]
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
        text += "".join(f"\n  {item.render()}" for item in self.listed)
        if self.interrupted:
            text += (
                "\n  interrupted by a signal: what it admitted is listed; run it again for the"
                " rest (occurrences already admitted are left alone)"
            )
        if not self.apply:
            text += "\n  dry run: nothing changed; add --apply to do it"
        elif self.published == 0 and self.new + self.reopened:
            text += "\n  the next relay publish sends them (or use --publish)"
        return text


@dataclass(frozen=True)
class _Occurrence:
    delivery: NewDelivery
    timezone: str  # of the schedule that owed it

    def listed(self, action: str) -> Listed:
        d = self.delivery
        return Listed(d.reminder_id, d.occurrence_at, self.timezone, d.channel, action)


async def _owed(
    pool: asyncpg.Pool, row: asyncpg.Record, start: datetime, end: datetime
) -> list[_Occurrence]:
    """What the reminder owed in the window under the schedule in force at each instant
    (a reminder without a recorded history: its schedule now, as before there was one)."""
    versions = await schedule_history.versions_of(pool, row["id"])
    if not versions:
        versions = [schedule_history.Version(schedule.from_row(row))]
    found = schedule_history.owed_between(versions, start, end, MAX_PER_REMINDER + 1)
    if len(found) > MAX_PER_REMINDER:
        raise errors.InputError(
            f"reminder {row['id']}: more than {MAX_PER_REMINDER} occurrences in the window; "
            "backfill a narrower one"
        )
    return [_Occurrence(NewDelivery.of(row, o.at), o.schedule.timezone) for o in found]


async def _one(
    pool: asyncpg.Pool, lock: publish_runs.RunLock, row: asyncpg.Record, summary: BackfillSummary
) -> None:
    owed = await _owed(pool, row, summary.start, summary.end)
    if not owed:
        return
    summary.in_window += len(owed)
    have = await control.existing_keys(pool, [o.delivery.key for o in owed])
    missing = [o for o in owed if o.delivery.key not in have]
    paused = [o for o in owed if have.get(o.delivery.key) == (State.SKIPPED, "paused")]
    summary.already += len(have) - len(paused)
    if not summary.apply:
        summary.new += len(missing)
        summary.reopened += len(paused)
        summary.listed += _listing(missing, paused, lambda o: True)
        return
    if not missing and not paused:
        return
    if summary.run_id is None:  # the first occurrence to admit opens the backfill run
        started = await lock.start("backfill", summary.start, socket.gethostname())
        summary.run_id = started.run_id
    await lock.keep()
    async with pool.acquire() as conn, conn.transaction():
        inserted = await admission.insert_deliveries(
            conn, [o.delivery for o in missing], summary.run_id
        )
        reopened = await control.reopen_paused(
            conn, [o.delivery.key for o in paused], summary.run_id
        )
    summary.new += len(inserted)
    summary.reopened += len(reopened)
    summary.already += len(missing) - len(inserted) + len(paused) - len(reopened)
    summary.ready += [(i.id, i.urgent, i.occurrence_at) for i in inserted] + reopened
    # One reminder's rows are told apart by their occurrence: list those admitted.
    admitted = {i.occurrence_at for i in inserted} | {at for _, _, at in reopened}
    summary.listed += _listing(missing, paused, lambda o: o.delivery.occurrence_at in admitted)


def _listing(
    missing: list[_Occurrence], paused: list[_Occurrence], keep: Callable[[_Occurrence], bool]
) -> list[Listed]:
    items = [o.listed("new") for o in missing if keep(o)]
    items += [o.listed("reopen") for o in paused if keep(o)]
    return sorted(items, key=lambda item: item.occurrence_at)


async def _prepare(
    pool: asyncpg.Pool, reminder_id: str | None, start: datetime, end: datetime, *, apply: bool
) -> tuple[BackfillSummary, list[asyncpg.Record]]:
    """The summary to fill and the reminders to look at, once the window is checked."""
    now = await pool.fetchval(db.q("db_now"))
    reached = await retention.horizon(pool)
    retention.refuse_reaching_back(
        start,
        reached.rows_purged_before,
        "--from",
        "a backfill cannot tell what was sent: the rows of deliveries that ended were purged",
    )
    summary = BackfillSummary(apply, start, min(end, now))
    rows = await pool.fetch(db.q("backfill_reminders"), reminder_id)
    if reminder_id is not None and not rows:
        raise errors.InputError(f"--reminder: no reminder {reminder_id!r}")
    return summary, rows


async def admit(pool: asyncpg.Pool, rows: list[asyncpg.Record], summary: BackfillSummary) -> None:
    """Count (or, ``summary.apply``, admit) the window's occurrences the ledger lacks."""
    progress = Progress("backfill")
    # Held for the run's life: its session's lock on the run tells later runs it is alive.
    async with publish_runs.RunLock(pool) as lock:
        try:
            for row in rows:
                await _one(pool, lock, row, summary)
                summary.reminders += 1
                progress.update(summary.reminders, len(rows))
        except asyncio.CancelledError:
            # SIGTERM or SIGINT (run() below): recorded so, not as 'ok'; the transaction it
            # was in rolled back.
            summary.interrupted = True
            raise
        finally:
            progress.finish()
            if summary.run_id is not None:
                await lock.keep()
                await _finish(pool, summary)


async def _finish(pool: asyncpg.Pool, summary: BackfillSummary) -> None:
    assert summary.run_id is not None
    await publish_runs.finish(
        pool,
        summary.run_id,
        "interrupted" if summary.interrupted else "ok" if summary.failed == 0 else "incomplete",
        due=summary.in_window,
        created=summary.new + summary.reopened,
        skipped=0,
        published=summary.published,
        rescued=0,
        failed=summary.failed,
        error=None,
    )


async def publish(
    stack: contextlib.AsyncExitStack,
    settings: Settings,
    pool: asyncpg.Pool,
    summary: BackfillSummary,
) -> None:
    """Publish the admitted rows now (through the timer when not due yet); the broker
    connection is closed with the run's other resources (``stack``)."""
    if not summary.ready:
        return
    connection, publisher = await publishing.open_publisher(settings, "relay-backfill")
    stack.push_async_callback(amqp.close_connection, connection, _CLOSE_SECONDS)
    now = await pool.fetchval(db.q("db_now"))
    items = [(i, urgent, (at - now).total_seconds()) for i, urgent, at in summary.ready]
    try:
        confirmed, failed = await publisher.publish_many(items)
    except asyncio.CancelledError:
        # Stopped while publishing: none is marked queued, so all stay pending for the
        # next relay publish (a message that did reach the queue makes its copy a no-op).
        summary.interrupted = True
        summary.failed = len(items)
        raise
    await publication.mark_queued(pool, confirmed)
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
    """Composition root of ``relay backfill``.

    SIGTERM or SIGINT (a Job's deadline, Ctrl-C) stop it where it is: the run records
    itself ``interrupted`` (stopped while publishing: ``incomplete``, its rows pending for
    the next ``relay publish``), and the summary says what was done (exit 1).
    """
    async with contextlib.AsyncExitStack() as stack:
        pool = await db.create_pool(settings, size=2)
        stack.push_async_callback(db.close_pool, pool, _CLOSE_SECONDS)
        summary, rows = await _prepare(pool, reminder_id, start, end, apply=apply)
        with signals.cancelling_on_signals():
            await admit(pool, rows, summary)
            if apply and publish_now:
                try:
                    await publish(stack, settings, pool, summary)
                finally:
                    if summary.run_id is not None and summary.ready:
                        await publish_runs.record_published(
                            pool, summary.run_id, summary.published, summary.failed
                        )
        return summary
    raise AssertionError("unreachable")
