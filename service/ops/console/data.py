"""What the console shows, read through named blocks of ``sql/queries.sql``.

Pages and the JSON API call the same functions and get plain dicts (JSON-ready after
``jsonable``). No payload is ever read. Recipients and text from outside (errors, a
partner's reply) are redacted by ``service.ops.redaction`` exactly as the CLI's output is,
unless the page was revealed (a recorded action; ``reveal``). Destinations are named in
URLs only by their keyed reference (``refs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from service import db, events, ledger, runs, suppressions
from service.ledger import control
from service.ops import redaction
from service.ops.console import refs

STATES = tuple(s.value for s in ledger.State)
CHANNELS = ("webhook", "email", "sms")
PAGE = 100


@dataclass(frozen=True)
class MissingFilter:
    """Which of a run's undelivered rows to list (None: any)."""

    state: str | None = None
    channel: str | None = None
    destination_ref: str | None = None
    after_id: int = 0

    def as_query(self) -> dict[str, str]:
        """The filter as URL query fields (no address in it: only the reference)."""
        fields = {"state": self.state, "channel": self.channel, "destination": self.destination_ref}
        return {k: v for k, v in fields.items() if v}


def jsonable(value: Any) -> Any:
    """``value`` with datetimes as ISO 8601 strings, recursively."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


async def run_list(executor: ledger.Executor, count: int = 50) -> list[dict[str, Any]]:
    """The latest runs, newest first, as ``relay status`` reports them."""
    now = await executor.fetchval(db.q("db_now"))
    return [_report(r) for r in await runs.reports(executor, None, count, now)]


async def run_one(executor: ledger.Executor, run_id: int) -> dict[str, Any] | None:
    now = await executor.fetchval(db.q("db_now"))
    found = await runs.reports(executor, run_id, 1, now)
    return _report(found[0]) if found else None


def _report(report: runs.RunReport) -> dict[str, Any]:
    return report.as_dict() | {"held": report.held_at is not None}


async def run_actions(executor: ledger.Executor, run_id: int) -> list[dict[str, Any]]:
    """Who held, released, cancelled or dead-lettered the run, when and why (oldest first)."""
    return [dict(a.__dict__) for a in await control.actions_of(executor, [run_id])]


def shown_row(row: dict[str, Any], reveal: bool = False) -> dict[str, Any]:
    """A delivery or destination row as shown: its ``destination`` and its text from
    outside (``last_error``, ``error``, ``response_excerpt``) redacted as the CLI does,
    unless revealed."""
    if reveal:
        return row
    shown = dict(row)
    if "destination" in shown:
        shown["destination"] = redaction.destination(shown.get("channel"), shown["destination"])
    for name in ("last_error", "error", "response_excerpt"):
        if name in shown:
            shown[name] = redaction.text(shown[name])
    return shown


async def run_missing(
    executor: ledger.Executor,
    key: refs.RefKey,
    run_id: int,
    selection: MissingFilter,
    limit: int = PAGE,
    *,
    reveal: bool = False,
) -> list[dict[str, Any]]:
    """One page of the run's deliveries that were not delivered."""
    rows = await executor.fetch(
        db.q("console_run_missing"),
        run_id,
        selection.state,
        selection.channel,
        selection.destination_ref,
        selection.after_id,
        limit,
        key.inner,
        key.outer,
    )
    return [shown_row(dict(r), reveal) for r in rows]


async def delivery(
    executor: ledger.Executor, key: refs.RefKey, delivery_id: int, *, reveal: bool = False
) -> dict[str, Any] | None:
    """One delivery (no payload) with its attempts, oldest first."""
    row = await executor.fetchrow(db.q("console_delivery"), delivery_id, key.inner, key.outer)
    if row is None:
        return None
    found = shown_row(dict(row), reveal)
    attempts = await executor.fetch(db.q("console_attempts"), delivery_id)
    found["attempt_list"] = [shown_row(dict(a), reveal) for a in attempts]
    return found


async def dead(
    executor: ledger.Executor,
    run_id: int | None,
    channel: str | None,
    before_id: int | None = None,
    limit: int = PAGE,
    *,
    reveal: bool = False,
) -> dict[str, Any]:
    """The dead deliveries (newest first), their total, and the latest replays."""
    rows = await executor.fetch(db.q("console_dead"), run_id, channel, before_id, limit)
    replays = await executor.fetch(db.q("console_replays_recent"), 10)
    return {
        "total": int(await executor.fetchval(db.q("console_dead_count"))),
        "deliveries": [shown_row(dict(r), reveal) for r in rows],
        "replays": [dict(r) for r in replays],
    }


async def destinations(
    executor: ledger.Executor,
    key: refs.RefKey,
    ref: str | None = None,
    limit: int = 500,
    *,
    reveal: bool = False,
) -> list[dict[str, Any]]:
    """Destinations named by reminders or disabled, disabled first."""
    rows = await executor.fetch(db.q("console_destinations"), ref, limit, key.inner, key.outer)
    return [shown_row(dict(r), reveal) | {"disabled": r["disabled_at"] is not None} for r in rows]


async def suppression_list(
    executor: ledger.Executor, key: refs.RefKey, channel: str | None, *, reveal: bool = False
) -> list[dict[str, Any]]:
    """The suppression list, lifted ones too, newest first: each address by its keyed
    reference, and itself only when revealed; the words beside it (a provider's code, an
    operator's why) redacted as the CLI's output is, unless revealed."""
    found = await suppressions.listed(executor, channel, include_removed=True, limit=500)
    rows = []
    for s in found:
        row = dict(s.__dict__) | {"address_ref": key.of(s.address)}
        if not reveal:
            row["address"] = redaction.destination(s.channel, s.address)
            for name in ("detail", "removed_reason"):
                row[name] = redaction.text(row[name])
        rows.append(row)
    return rows


async def event(
    executor: ledger.Executor, key: refs.RefKey, event_id: int, *, reveal: bool = False
) -> dict[str, Any] | None:
    """One event (never its payload) with each of its deliveries (one per destination it
    was fanned out to), redacted as every delivery row is unless revealed."""
    found = await events.get(executor, event_id)
    if found is None:
        return None
    rows = await executor.fetch(db.q("console_event_deliveries"), event_id, key.inner, key.outer)
    found["delivery_list"] = [shown_row(dict(r), reveal) for r in rows]
    return found


async def record_reveal(executor: ledger.Executor, operator: str, page: str, at: datetime) -> int:
    """Record that ``operator`` revealed ``page`` (its path and query) at ``at``."""
    return int(await executor.fetchval(db.q("console_reveal_record"), operator, page[:300], at))
