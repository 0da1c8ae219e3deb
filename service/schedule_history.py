"""A reminder's schedule history: which occurrences it owed, and under which schedule.

``relay reminders load`` records every schedule a reminder has had and the interval it
was in force (table ``reminder_schedules``, one :class:`Version` per row); this module
writes and reads that history and answers, piecewise, which occurrences a reminder owed
*as it was then*:

* a daily or cron version owes its occurrences ``t`` with ``valid_from <= t < valid_to``;
* a one-shot version owes its ``due_at`` when it was not replaced before it
  (``due_at < valid_to``), even when it was loaded after ``due_at``: a one-shot loaded
  late fires at once, so that occurrence was owed.

A reminder's first version holds from before it was loaded (``valid_from`` None): the
ledger knows no older schedule. Occurrences are told apart at the resolution of their
idempotency keys (whole seconds, ``service.ledger.admission.schedule_key``): two instants within
one second are one occurrence. The rules are in ``docs/schedules.md`` ("Editing a
schedule").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from service import schedule
from service.db import q
from service.ledger import Connection, Executor

_ONE_US = timedelta(microseconds=1)
_ONE_S = timedelta(seconds=1)


@dataclass(frozen=True)
class Version:
    """One schedule of a reminder and the interval ``[valid_from, valid_to)`` it held."""

    schedule: schedule.Schedule
    valid_from: datetime | None = None  # None: since before the reminder was loaded
    valid_to: datetime | None = None  # None: in force now


@dataclass(frozen=True)
class Owed:
    """An occurrence a reminder owed, with the schedule in force for it."""

    at: datetime  # UTC
    schedule: schedule.Schedule


def _in_force(version: Version, at: datetime) -> bool:
    if version.valid_to is not None and at >= version.valid_to:
        return False
    if version.schedule.kind == "once":
        return True  # a one-shot loaded after its due_at still owes it
    return version.valid_from is None or at >= version.valid_from


def _second(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(microsecond=0)


def owes(version: Version, at: datetime) -> bool:
    """Whether ``version`` owes the occurrence at ``at`` (the same key: the same second)."""
    start = _second(at)
    found = schedule.occurrences(version.schedule, start, start + _ONE_S - _ONE_US, 1)
    return bool(found) and _in_force(version, found[0])


def owed_between(
    versions: Iterable[Version], start: datetime, end: datetime, limit: int
) -> list[Owed]:
    """The occurrences ``start <= t <= end`` the version in force owed, increasing, one per
    second, at most ``limit`` (ask for one more than you accept to detect "too many")."""
    found: dict[datetime, Owed] = {}
    for version in versions:
        lo, hi = start, end
        if version.valid_from is not None and version.schedule.kind != "once":
            lo = max(lo, version.valid_from)
        if version.valid_to is not None:
            hi = min(hi, version.valid_to - _ONE_US)
        for at in schedule.occurrences(version.schedule, lo, hi, limit):
            found.setdefault(_second(at), Owed(at, version.schedule))
    return [found[key] for key in sorted(found)][:limit]


def from_rows(rows: Sequence[schedule.Row]) -> list[Version]:
    """The versions of ``schedule_versions`` rows (oldest first)."""
    return [Version(schedule.from_row(r), r["valid_from"], r["valid_to"]) for r in rows]


async def versions_of(executor: Executor, reminder_id: str) -> list[Version]:
    """One reminder's schedule history, oldest first (empty: none recorded)."""
    return from_rows(await executor.fetch(q("schedule_versions"), reminder_id))


async def record(
    conn: Connection, first: Sequence[str], changed: Sequence[str], at: datetime
) -> None:
    """After an upsert (in its transaction): ``first`` (reminders loaded for the first time)
    start their history; ``changed`` (a new schedule) close theirs at ``at`` and open the
    schedule the reminder row now has."""
    if first or changed:
        await conn.execute(q("record_schedules"), list(first), list(changed), at)
