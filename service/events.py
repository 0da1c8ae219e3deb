"""Business events: the event-type catalogue, what recording an event fans out to (the
statement itself is ``service.ledger.intake``'s), and the reads the tools share.

An application records an event with ``service.outbox.add_event`` inside its own
transaction. That one statement (``event_add``, run by ``service.ledger.intake``) inserts
the event and, **in the same transaction**, one pending delivery per destination subscribed
to it (``service.subscriptions``): an ordinary outbox delivery with its own destination, payload,
rate budget and idempotency key ``event:<event key>:<destination id>``. Downstream it is a
delivery like any other: the publish run's pending sweep publishes it, a consumer claims it
and signs it with its destination's own secret, and retries, the circuit breaker, dead
letters, replay, a disabled destination's hold and ``relay deliveries show`` all apply to
it alone.

The same key recorded again inserts nothing, neither event nor delivery: an event is fanned
out once, to the subscriptions in force when it was first recorded. A disabled
destination's delivery is created and held, as every delivery of a disabled destination is
(its enable sends them); a destination subscribed later is owed older events only through
a backfill (``service.ledger.intake.backfill_events``).
"""

from __future__ import annotations

import re
from typing import Any

import asyncpg

from service import entry, event_schema, limits
from service.db import q

Connection = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy
Executor = Connection | asyncpg.Pool

KEY_PREFIX = "event:"
# An event's key leaves room for the namespace and ":<destination id>" (a bigint) in the
# delivery's key, which every receiver accepts (at most 256 characters).
MAX_KEY_CHARS = limits.MAX_IDEMPOTENCY_KEY_CHARS - len(KEY_PREFIX) - len(":") - 19
MAX_DESCRIPTION_CHARS = 500
_TYPE_NAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


def type_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name an event type, or None: dot-separated words of ASCII
    letters, digits, '_' and '-', at most 100 characters (``shipment.delayed``)."""
    if not isinstance(name, str) or len(name) > 100 or not _TYPE_NAME.fullmatch(name):
        return (
            "use dot-separated words of ASCII letters, digits, '_' and '-', "
            "at most 100 characters (shipment.delayed)"
        )
    return None


def delivery_key(event_key: str, destination_id: int) -> str:
    """The idempotency key of an event's delivery to one destination (what the SQL
    builds; for tests and tools)."""
    return f"{KEY_PREFIX}{event_key}:{destination_id}"


# ---------------------------------------------------------------------------- catalogue


async def add_type(
    executor: Executor, name: str, description: str, schema: dict[str, Any] | bool | None
) -> str:
    """Add an event type or change its description and schema: ``added``, ``updated`` or
    ``unchanged``. Raises ValueError naming what is wrong (nothing written)."""
    problem = type_name_problem(name)
    if problem is not None:
        raise ValueError(f"event type {name!r}: {problem}")
    if len(description) > MAX_DESCRIPTION_CHARS or entry.text_problem(description):
        raise ValueError(f"--description: at most {MAX_DESCRIPTION_CHARS} characters, no NUL")
    if schema is not None and (problem := event_schema.schema_problem(schema)):
        raise ValueError(f"--schema: {problem}")
    row = await executor.fetchrow(q("event_type_upsert"), name, description, schema)
    if row is None:
        return "unchanged"
    return "added" if row["added"] else "updated"


async def types(executor: Executor, name: str | None = None) -> list[dict[str, Any]]:
    """The catalogue (or one type), each with how many destinations subscribe to it."""
    return [dict(r) for r in await executor.fetch(q("event_types_list"), name)]


async def subscribers(executor: Executor, name: str) -> list[dict[str, Any]]:
    """The subscriptions that take type ``name``, by destination."""
    return [dict(r) for r in await executor.fetch(q("event_type_subscribers"), name)]


async def schema_of(conn: Connection, name: str) -> tuple[bool, Any]:
    """(whether the type is catalogued, its schema or None)."""
    row = await conn.fetchrow(q("event_type_schema"), name)
    return (False, None) if row is None else (True, row["schema"])


# ------------------------------------------------------------------------------- record


# -------------------------------------------------------------------------------- reads


async def get(
    executor: Executor, event_id: int | None = None, key: str | None = None
) -> dict[str, Any] | None:
    """One event (never its payload), by id or key, with its deliveries' count."""
    row = await executor.fetchrow(q("event_get"), event_id, key)
    return None if row is None else dict(row)


async def recent(
    executor: Executor, limit: int, before_id: int | None = None, event_type: str | None = None
) -> list[dict[str, Any]]:
    """The latest events, newest first, with how their deliveries stand."""
    rows = await executor.fetch(q("events_recent"), limit, before_id, event_type)
    return [dict(r) for r in rows]


async def missing(executor: Executor, limit: int) -> list[dict[str, Any]]:
    """Events with deliveries not delivered, newest first: one entry per event, its rows
    not delivered under ``missing`` (at most ``limit`` rows in all)."""
    grouped: dict[int, dict[str, Any]] = {}
    for r in await executor.fetch(q("event_missing"), limit):
        row = dict(r)
        group = grouped.setdefault(
            row["event_id"],
            {
                "event_id": row["event_id"],
                "key": row["event_key"],
                "event_type": row["event_type"],
                "created_at": row["event_at"],
                "missing": [],
            },
        )
        for name in ("event_id", "event_key", "event_type", "event_at"):
            del row[name]
        group["missing"].append(row)
    return list(grouped.values())
