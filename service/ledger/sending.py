"""In and out of ``sending``: a consumer claims rows to send (``queued``/``retrying`` ->
``sending``, with a lease), gives back the ones it did not send, and writes what each
attempt did together with its attempt row, fenced by the attempt the claim owns.

Each function runs one named statement of ``sql/queries.sql`` whose ``WHERE`` is the
state machine; a row in another state is left alone and reported so ("someone else won").
The last check before a request is ``service.ledger.lastcheck``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime

import asyncpg

from service.db import q
from service.ledger.model import (
    Attempt,
    Claimed,
    Completion,
    Connection,
    Executor,
    State,
    Target,
    Unclaimable,
    retry_on_conflict,
    send_facts,
)

_NO_RECORD = Attempt(outcome="")  # a completion without an attempt row


def _clip(text: str | None, limit: int) -> str | None:
    return None if text is None else text[:limit]


# Claimed's fields read straight from the claim's columns (computed once: this runs per row).
_CLAIMED_COLUMNS = tuple(
    f.name for f in dataclasses.fields(Claimed) if f.name not in ("facts", "target")
)


def _claimed(r: asyncpg.Record) -> Claimed:
    target = Target(tuple(r["secrets"]), r["envelope"], r["event_type"], r["failure_streak"])
    return Claimed(**{n: r[n] for n in _CLAIMED_COLUMNS}, facts=send_facts(r), target=target)


async def claim(
    conn: Connection, ids: Sequence[int], lease_seconds: float
) -> tuple[dict[int, Claimed], dict[int, Unclaimable]]:
    """Claim many rows at once; return those taken and, for the rest, why not.

    The claim is one statement (atomic on its own); the look-up of the rest runs after it,
    so it sees the claim's result.
    """
    rows = await retry_on_conflict(lambda: conn.fetch(q("claim"), list(ids), lease_seconds))
    claimed = {r["id"]: _claimed(r) for r in rows}
    rest = [i for i in ids if i not in claimed]
    others: dict[int, Unclaimable] = {}
    if rest:
        for r in await conn.fetch(q("unclaimable"), rest):
            others[r["id"]] = Unclaimable(
                id=r["id"],
                state=State(r["state"]),
                next_attempt_at=r["next_attempt_at"],
                lease_expires_at=r["lease_expires_at"],
                now=r["now"],
                attempts=r["attempts"],
                last_status=r["last_status"],
                last_error=r["last_error"],
                dead_letter_missing=r["dead_letter_missing"],
                early_seconds=r["early_seconds"],
                republished=r["republished"],
            )
    return claimed, others


async def mark_dead_lettered(executor: Executor, delivery_id: int, attempt: int) -> None:
    """Record that the dead letter of this row's death was confirmed by the broker."""
    await executor.execute(q("mark_dead_lettered"), delivery_id, attempt)


async def complete(conn: Connection, completions: Sequence[Completion]) -> set[tuple[int, int]]:
    """Write outcomes and their attempt rows in one statement; return the (id, attempt)
    pairs whose outcome stands.

    A pair missing from the result lost its lease to another claim: its attempt row is
    still recorded (the send happened), its state is the other claimant's to write. Running
    the same completions twice reports the same pairs (safe to retry after a lost answer).
    """
    if not completions:
        return set()
    records = [c.record or _NO_RECORD for c in completions]
    args = (
        [c.id for c in completions],
        [c.attempt for c in completions],
        [c.state.value for c in completions],
        [c.next_attempt_at for c in completions],
        [c.status for c in completions],
        [_clip(c.error, 500) for c in completions],
        [_clip(c.receipt, 500) for c in completions],
        [c.skip_reason for c in completions],
        [r.outcome or None for r in records],
        [r.latency_ms for r in records],
        [_clip(r.error, 500) for r in records],
        [_clip(r.response_excerpt, 1000) for r in records],
        [r.payload_version for r in records],
        [r.started_at for r in records],
        [r.stale for r in records],
        [r.possibly_delivered for r in records],
        [_clip(r.provider_message_id, 128) for r in records],
    )
    rows = await retry_on_conflict(lambda: conn.fetch(q("complete"), *args))
    return {(r["id"], r["attempt"]) for r in rows}


async def release(
    executor: Executor, delivery_id: int, attempt: int, retry_at: datetime | None
) -> bool:
    """sending -> retrying at ``retry_at`` (or queued, due now, without one), without
    counting the attempt: the request was never made."""
    return await executor.fetchval(q("release"), delivery_id, attempt, retry_at) is not None
