"""Erasure by recipient: one transaction that removes or irreversibly redacts one
recipient's data from every table that can hold it (``relay erase``).

What each column gets is listed in ``service.erasure_columns``; who the recipient is (and
every stored spelling of it) is ``service.erasure_recipient``'s. The steps, in this order,
each one named statement (``erase_*`` in ``sql/queries.sql``):

1. the recipient's reminders are locked (in id order, before any delivery, as a load
   locks them), then its deliveries not final: if one is ``sending`` (claimed, its request
   maybe on the wire, its outcome still to be written) the erasure is refused
   (:class:`InFlight`) and nothing changes; the others stay locked, so a consumer's claim
   waits and then finds them final;
2. reminders become tombstones (``inactive_reason`` ``erased``); deliveries not sent yet
   are skipped (``erased``) and every one of the recipient's deliveries loses its
   destination, payload, last error and receipt; their attempts lose reply excerpts and
   errors; their receipts are deleted; reconciliations lose the provider's words; the
   recipient's suppressions are deleted; a URL's registry row goes with its own secrets,
   its disable/enable records and its subscriptions;
3. every mention of the recipient in free text or JSON anywhere (payloads of others,
   replies, operators' reasons, console pages) becomes ``[erased]``;
4. a last look: a delivery of the recipient claimed while this ran (one added meanwhile)
   refuses the erasure too, rolling everything back.

A dry run runs exactly these statements and rolls back, so its counts are what an apply
does (but for what changes in between). An applied erasure is recorded in ``erasures``
with a keyed hash of the recipient (the caller's ``recipient_ref``), never the recipient.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from service import errors, ledger
from service.db import q
from service.erasure_recipient import Recipient, mention_pattern, spellings_of

# Statements of an erasure read whole tables (the scrubs): no deadline but this one.
STATEMENT_SECONDS = 6 * 3600.0
MAX_REASON_CHARS = 500
MAX_OPERATOR_CHARS = 200


class InFlight(errors.RelayError):
    """The recipient has deliveries in flight (``sending``; or added and claimed while the
    erasure ran): nothing was changed. The message says how many and which (ids, states),
    never the recipient."""

    def __init__(self, rows: list[tuple[int, str]]) -> None:
        self.rows = rows
        shown = ", ".join(f"{i} ({state})" for i, state in rows[:10])
        super().__init__(
            f"refused: {len(rows)} of this recipient's deliveries in flight: {shown}"
            f"{', ...' if len(rows) > 10 else ''}; nothing changed. Run it again once they "
            "are final (a claim ends within RELAY_LEASE_SECONDS; a dead consumer's, at rescue)"
        )


class Refused(errors.ConfigError):
    """The operator's input cannot be recorded (exit 2); nothing was done."""


@dataclass(frozen=True)
class Earlier:
    """An earlier erasure of the same recipient (by its keyed hash)."""

    id: int
    operator: str
    reason: str
    at: datetime
    counts: dict[str, dict[str, int]]


@dataclass
class Erasure:
    """What an erasure changed (applied) or would change (a dry run), per table."""

    channel: str
    recipient_ref: str
    applied: bool
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    erasure_id: int | None = None
    at: datetime | None = None
    earlier: list[Earlier] = field(default_factory=list)

    def count(self, table: str, what: str, rows: int) -> None:
        if rows:
            self.counts.setdefault(table, {})[what] = rows

    @property
    def total(self) -> int:
        return sum(n for table in self.counts.values() for n in table.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "channel": self.channel,
            "recipient_ref": self.recipient_ref,
            "applied": self.applied,
            "erasure_id": self.erasure_id,
            "at": self.at,
            "counts": self.counts,
            "rows": self.total,
            "earlier": [e.__dict__ for e in self.earlier],
        }


def checked(text: str | None, what: str, limit: int, pattern: str, *, required: bool) -> str:
    """An operator's words for the record: stripped, at most ``limit`` characters, and never
    naming the recipient (the record must not hold it). Refused otherwise."""
    value = (text or "").strip()
    if required and not value:
        raise Refused(f"{what}: needed (recorded with the erasure; for a reason, a ticket)")
    if len(value) > limit:
        raise Refused(f"{what}: at most {limit} characters")
    if value and re.search(pattern, value, re.IGNORECASE):
        raise Refused(f"{what}: must not contain the recipient (the record never holds it)")
    return value


async def erase(
    conn: ledger.Connection,
    recipient: Recipient,
    *,
    recipient_ref: str,
    operator: str,
    reason: str | None,
    apply: bool,
) -> Erasure:
    """Erase (``apply``) or count (a dry run) ``recipient``'s data, in one transaction.

    Raises :class:`InFlight` (nothing changed) while one of its deliveries is being sent,
    and :class:`Refused` for a reason or operator the record cannot hold.
    """
    result = Erasure(recipient.channel, recipient_ref, apply)
    tx = conn.transaction()
    await tx.start()
    try:
        await conn.execute(q("erase_no_deadline"))
        stored = await conn.fetch(
            q("erase_spellings"), recipient.channel, recipient.prefix, timeout=STATEMENT_SECONDS
        )
        spellings = spellings_of(recipient, [r["stored"] for r in stored])
        pattern = mention_pattern(recipient, spellings)
        who = checked(operator, "--operator", MAX_OPERATOR_CHARS, pattern, required=True)
        why = checked(reason, "--reason", MAX_REASON_CHARS, pattern, required=apply)
        result.earlier = await _earlier(conn, recipient_ref)
        await _owned(conn, recipient, spellings, result)
        await _scrub(conn, pattern, result)
        if apply:
            row = await conn.fetchrow(
                q("erasure_record"), recipient.channel, recipient_ref, who, why, result.counts
            )
            assert row is not None
            result.erasure_id, result.at = row["id"], row["at"]
    except BaseException:
        await tx.rollback()
        raise
    if apply:
        await tx.commit()
    else:
        await tx.rollback()
    return result


async def _earlier(conn: ledger.Connection, recipient_ref: str) -> list[Earlier]:
    rows = await conn.fetch(q("erasures_of"), recipient_ref)
    return [Earlier(r["id"], r["operator"], r["reason"], r["at"], r["counts"]) for r in rows]


async def _owned(
    conn: ledger.Connection, recipient: Recipient, spellings: list[str], result: Erasure
) -> None:
    """Steps 1, 2 and 4: what is the recipient's own, refused while any of it is in flight."""
    channel, s, t = recipient.channel, spellings, STATEMENT_SECONDS
    ids = [r["id"] for r in await conn.fetch(q("erase_reminders_of"), channel, s, timeout=t)]
    open_rows = await conn.fetch(q("erase_in_flight"), channel, s, ids, timeout=t)
    _refuse([r for r in open_rows if r["state"] == "sending"])
    result.count("reminders", "erased", await conn.fetchval(q("erase_reminders"), ids))
    changed = await conn.fetch(q("erase_deliveries"), channel, s, ids, timeout=t)
    result.count("deliveries", "erased", len(changed))
    result.count("deliveries", "skipped", sum(1 for r in changed if r["open"]))
    mine = [r["id"] for r in changed]
    steps: list[tuple[str, str, str, tuple[Any, ...]]] = [
        ("delivery_attempts", "redacted", q("erase_attempts"), (mine,)),
        ("receipts", "deleted", q("erase_receipts"), (mine,)),
        ("reconciliations", "redacted", q("erase_reconciliations"), (mine,)),
        ("suppressions", "deleted", q("erase_suppressions"), (channel, s)),
    ]
    if channel == "webhook":  # the registry's row last: the others reference it
        steps += [
            ("event_subscriptions", "deleted", q("erase_event_subscriptions"), (s,)),
            ("destination_actions", "deleted", q("erase_destination_actions"), (s,)),
            ("destination_secrets", "deleted", q("erase_destination_secrets"), (s,)),
            ("destinations", "deleted", q("erase_destinations"), (s,)),
        ]
    for table, what, statement, args in steps:
        result.count(table, what, await conn.fetchval(statement, *args, timeout=t))
    # A delivery of the recipient added (and claimed) while this ran is not erased.
    _refuse(await conn.fetch(q("erase_left_unerased"), channel, s, ids, timeout=t))


def _refuse(rows: list[Any]) -> None:
    if rows:
        raise InFlight([(r["id"], r["state"]) for r in rows])


async def _scrub(conn: ledger.Connection, pattern: str, result: Erasure) -> None:
    """Step 3: each mention in free text or JSON, in every row, becomes ``[erased]``."""
    t = STATEMENT_SECONDS
    for table, statement in (
        ("reminders", q("erase_scrub_reminders")),
        ("deliveries", q("erase_scrub_deliveries")),
        ("delivery_attempts", q("erase_scrub_attempts")),
        ("suppressions", q("erase_scrub_suppressions")),
        ("destinations", q("erase_scrub_destinations")),
        ("destination_actions", q("erase_scrub_destination_actions")),
        ("event_subscriptions", q("erase_scrub_event_subscriptions")),
        ("events", q("erase_scrub_events")),
        ("event_types", q("erase_scrub_event_types")),
        ("publish_runs", q("erase_scrub_publish_runs")),
        ("run_actions", q("erase_scrub_run_actions")),
        ("replays", q("erase_scrub_replays")),
        ("console_reveals", q("erase_scrub_console_reveals")),
    ):
        result.count(table, "mentions scrubbed", await conn.fetchval(statement, pattern, timeout=t))
