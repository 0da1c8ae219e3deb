"""Intake from outside the schedule: rows an application or an operator adds, each
``pending`` with its own destination and payload (``source = 'outbox'``), keyed by
business identity so that adding one twice adds it once.

* an outbox intent, in the application's own transaction (``service.outbox`` checks it);
* a business event and its fan-out: the event and one row per destination subscribed to
  it, in one statement (``service.events`` says who is owed it);
* a subscription's backfill: the events a destination's subscription takes that were
  recorded in a window, as the fan-out would have made them (the same keys).

Rows scheduled by reminders enter through ``service.ledger.admission``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from service.db import q
from service.ledger.model import Connection, outbox_key


async def insert_intent(
    conn: Connection,
    key: str,
    channel: str,
    provider: str,
    destination: str,
    payload: dict[str, Any],
    urgent: bool,
    event_type: str | None,
) -> int | None:
    """Insert an outbox intent (a pending delivery due now, keyed ``outbox_key(key)``);
    its id, or None if the key exists. asyncpg raises ``DataError`` before anything
    reaches the server when the connection cannot encode ``payload`` as jsonb."""
    delivery_id = await conn.fetchval(
        q("insert_outbox_intent"),
        outbox_key(key),
        channel,
        provider,
        destination,
        payload,
        None,  # occurrence_at: the transaction's time (now())
        urgent,
        event_type,
    )
    return None if delivery_id is None else int(delivery_id)


@dataclass(frozen=True)
class Recorded:
    """An event recorded now, and how many deliveries its fan-out created."""

    event_id: int
    deliveries: int


async def record_event(
    conn: Connection, key: str, event_type: str, payload: dict[str, Any], urgent: bool
) -> Recorded | None:
    """Insert the event and its deliveries (the caller checked everything and holds the
    transaction); None when the key was recorded before (nothing inserted)."""
    row = await conn.fetchrow(q("event_add"), key, event_type, payload, urgent)
    assert row is not None
    if row["event_id"] is None:
        return None
    return Recorded(int(row["event_id"]), int(row["deliveries"]))


async def backfill_events(
    conn: Connection, url: str, pattern: str, since: datetime, until: datetime
) -> list[tuple[int, bool, datetime]]:
    """Owe the destination the events its subscription ``pattern`` takes that were recorded
    in [since, until), as if it had been subscribed then: the same keys, so an event it
    already has adds nothing. The new pending rows (the next publish run sends them)."""
    rows = await conn.fetch(q("subscription_backfill"), url, pattern, since, until)
    return [(r["id"], r["urgent"], r["occurrence_at"]) for r in rows]
