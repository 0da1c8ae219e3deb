"""Loading reminders into the ledger: the upsert of one chunk, the schedule history it
keeps, and what an edit of a schedule does to the occurrences already admitted.

All of it runs in the load's transaction (the caller's), the chunk's reminders locked
first (so no publish run admits for them meanwhile, and every row admitted before is
seen):

* a reminder loaded for the first time starts its schedule history;
* a reminder whose schedule changed closes its version at the edit's instant ``at`` and
  opens the new one from then (``service.schedule_history``);
* its admitted occurrences due at or after ``at``, not final and not in flight, that the
  new schedule does not owe are skipped with reason ``rescheduled``: moving a reminder
  from 06:00 to 07:00 inside the publish look-ahead sends 07:00 only. Occurrences due
  before ``at`` were owed by the schedule in force then and are left alone, and so is
  everything on a payload-only edit (a row reads the payload when it is sent);
* a line naming an erased reminder (``relay erase``) is left out (:func:`not_erased`):
  the tombstone keeps no destination or payload, and a load never brings them back (the
  statements guard it too, for an erasure that commits meanwhile).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from service import control, schedule, schedule_history
from service.db import q
from service.ledger import Connection


@dataclass(frozen=True)
class Edited:
    """What one chunk's upsert changed besides the reminder rows."""

    first: list[str]  # reminders loaded for the first time
    rescheduled: list[str]  # reminders whose schedule changed
    skipped: list[int]  # delivery ids skipped 'rescheduled'


@dataclass
class Tally:
    """What the edits of a whole load did (summed over its chunks), for its summary line."""

    rescheduled: int = 0  # reminders whose schedule changed
    skipped: int = 0  # admitted occurrences skipped 'rescheduled'
    erased: int = 0  # lines naming erased reminders, left out

    def add(self, edited: Edited) -> None:
        self.rescheduled += len(edited.rescheduled)
        self.skipped += len(edited.skipped)

    def render(self) -> str:
        """``""`` when no schedule changed and no line was left out, else what happened."""
        text = ""
        if self.rescheduled:
            text += (
                f"; schedule changed for {self.rescheduled} "
                f"({self.skipped} admitted occurrences skipped: rescheduled)"
            )
        if self.erased:
            text += f"; {self.erased} lines name erased reminders (relay erase): not loaded"
        return text


T = TypeVar("T")


async def not_erased(
    conn: Connection, items: list[T], id_of: Callable[[T], str], tally: Tally | None
) -> list[T]:
    """``items`` but those whose reminder was erased (counted in ``tally``)."""
    if not items:
        return items
    erased = {r["id"] for r in await conn.fetch(q("reminders_erased"), [id_of(i) for i in items])}
    if tally is not None:
        tally.erased += sum(1 for i in items if id_of(i) in erased)
    return [i for i in items if id_of(i) not in erased] if erased else items


async def upsert(
    conn: Connection,
    columns: Sequence[Sequence[Any]],
    schedules: Mapping[str, schedule.Schedule],
    at: datetime,
) -> Edited:
    """Upsert a chunk (``columns`` of ``upsert_reminders``; ``schedules``: id -> the
    schedule each line gives) as an edit made at ``at``, inside the caller's transaction."""
    ids = list(schedules)
    locked = await conn.fetch(q("lock_reminder_schedules"), ids)
    before = {r["id"]: schedule.from_row(r) for r in locked}
    erased = {r["id"] for r in locked if r["erased"]}  # the upsert leaves them as they are
    await conn.execute(q("upsert_reminders"), *columns)
    first = [i for i in ids if i not in before]
    changed = [i for i in ids if i in before and i not in erased and before[i] != schedules[i]]
    await schedule_history.record(conn, first, changed, at)
    skipped = await _skip_unowed(conn, changed, schedules, at)
    return Edited(first, changed, skipped)


async def _skip_unowed(
    conn: Connection,
    changed: Sequence[str],
    schedules: Mapping[str, schedule.Schedule],
    at: datetime,
) -> list[int]:
    if not changed:
        return []
    admitted = await conn.fetch(q("admitted_from"), list(changed), at)
    unowed = [
        r["id"]
        for r in admitted
        if not schedule_history.owes(
            schedule_history.Version(schedules[r["reminder_id"]], valid_from=at),
            r["occurrence_at"],
        )
    ]
    return await control.skip_rescheduled(conn, unowed)
