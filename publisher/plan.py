"""Planning one admission batch: which occurrences each due reminder owes (sent or
skipped, and why) and where its schedule moves on. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

import asyncpg

from service import logs, runs, schedule
from service.ledger.admission import NewDelivery
from service.settings import Settings

log = logs.get("publisher")

SKIP_PAUSED = "paused"


def plan_batch(
    rows: Sequence[asyncpg.Record],
    now: datetime,
    settings: Settings,
    paused: Sequence[tuple[datetime, datetime]] = (),
) -> tuple[list[NewDelivery], list[tuple[str, datetime | None]]]:
    """Owed occurrences (sent or skipped), those falling due within the look-ahead
    included, and the new next_due_at of each reminder.

    An occurrence due inside a window admission was paused (``paused``: start, end) is
    skipped with reason ``paused``, whatever the missed-fire policy says: resuming does
    not replay what the pause stopped (``relay backfill`` does, on purpose)."""
    horizon = now + timedelta(seconds=settings.publish_lookahead_seconds)
    deliveries: list[NewDelivery] = []
    advances: list[tuple[str, datetime | None]] = []
    for row in rows:
        try:
            plan = schedule.plan_due(
                schedule.from_row(row),
                row["next_due_at"],
                now,
                row["missed_policy"],
                timedelta(seconds=settings.misfire_grace_seconds),
                settings.catch_up_limit,
                horizon=horizon,
            )
        except schedule.ScheduleError as exc:
            # A schedule that cannot be computed must not block the scan: stop it, loudly.
            log.error(
                "reminder schedule invalid; stopped firing",
                extra={"event": "schedule_invalid", "reminder_id": row["id"], "reason": str(exc)},
            )
            advances.append((row["id"], None))
            continue
        owed = [(at, None) for at in plan.send] + list(plan.skipped)
        for at, reason in owed:
            if runs.in_pause(at, paused):
                reason = SKIP_PAUSED
            deliveries.append(NewDelivery.of(row, at, reason))
        advances.append((row["id"], plan.next_due_at))
    return deliveries, advances
