"""Admission: what is owed. Due reminders are locked, their owed occurrences inserted as
delivery rows (one per occurrence, keyed by business identity) and their schedules
advanced, all inside one transaction per batch (the caller's).

The only code that runs these statements (the reminders' locking and advancing too: they
are one transaction with the inserts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg

from service.db import q
from service.ledger.model import Connection, Executor, State


def schedule_key(reminder_id: str, occurrence_at: datetime, channel: str) -> str:
    """The idempotency key of one occurrence: business identity, never discovery time."""
    instant = occurrence_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"reminder:{reminder_id}:{instant}:{channel}"


async def oldest_due(executor: Executor, now: datetime) -> datetime | None:
    """The earliest next occurrence of an active reminder that is due by ``now``."""
    result: datetime | None = await executor.fetchval(q("oldest_due"), now)
    return result


async def lock_due_reminders(conn: Connection, now: datetime, limit: int) -> list[asyncpg.Record]:
    """Lock one admission batch of due reminders (inside the caller's transaction).

    SKIP LOCKED lets overlapping publish runs share the work without waiting.
    """
    return list(await conn.fetch(q("lock_due_reminders"), now, limit))


async def advance_reminders(
    conn: Connection, advances: Sequence[tuple[str, datetime | None]]
) -> None:
    """Move each reminder's next occurrence on (None: nothing more to fire)."""
    await conn.execute(
        q("advance_reminders"), [rid for rid, _ in advances], [at for _, at in advances]
    )


@dataclass(frozen=True)
class NewDelivery:
    """One owed occurrence for ``insert_deliveries``."""

    key: str
    reminder_id: str
    channel: str
    provider: str
    occurrence_at: datetime
    urgent: bool
    skip_reason: str | None = None

    @classmethod
    def of(
        cls, reminder: asyncpg.Record, at: datetime, skip_reason: str | None = None
    ) -> NewDelivery:
        """The occurrence of ``reminder`` (its ``reminders`` row) at ``at``, keyed by its
        business identity: a publish run and a backfill owe the same row, once."""
        return cls(
            key=schedule_key(reminder["id"], at, reminder["channel"]),
            reminder_id=reminder["id"],
            channel=reminder["channel"],
            provider=reminder["provider"],
            occurrence_at=at,
            urgent=reminder["urgent"],
            skip_reason=skip_reason,
        )


@dataclass(frozen=True)
class Inserted:
    """A delivery row an admission created."""

    id: int
    urgent: bool
    state: State
    occurrence_at: datetime


async def insert_deliveries(
    conn: Connection, rows: Sequence[NewDelivery], run_id: int
) -> list[Inserted]:
    """Insert owed occurrences; existing keys insert nothing."""
    if not rows:
        return []
    result = await conn.fetch(
        q("insert_deliveries"),
        [r.key for r in rows],
        [r.reminder_id for r in rows],
        [r.channel for r in rows],
        [r.provider for r in rows],
        [r.occurrence_at for r in rows],
        [r.urgent for r in rows],
        [r.skip_reason for r in rows],
        run_id,
    )
    return [Inserted(r["id"], r["urgent"], State(r["state"]), r["occurrence_at"]) for r in result]
