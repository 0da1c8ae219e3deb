"""The ledger state machine: one typed function per transition over ``deliveries``.

Each function runs one named statement from ``sql/queries.sql``. A transition that
finds its row in another state does nothing and says so (an empty result), because
"someone else won" is a normal answer in a system with redelivery and rescue.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg

from service.db import q

# A connection (or pool proxy) to run one statement on; transactions need a connection.
Connection = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy
Executor = Connection | asyncpg.Pool


class State(enum.StrEnum):
    """Mirrors the ``delivery_state`` enum of the database."""

    PENDING = "pending"
    QUEUED = "queued"
    SENDING = "sending"
    RETRYING = "retrying"
    DELIVERED = "delivered"
    DEAD = "dead"
    SKIPPED = "skipped"


FINAL_STATES = frozenset({State.DELIVERED, State.DEAD, State.SKIPPED})


def schedule_key(reminder_id: str, occurrence_at: datetime, channel: str) -> str:
    """The idempotency key of one occurrence: business identity, never discovery time."""
    instant = occurrence_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"reminder:{reminder_id}:{instant}:{channel}"


def outbox_key(key: str) -> str:
    """The idempotency key of an outbox intent, namespaced apart from schedule keys."""
    return f"outbox:{key}"


@dataclass(frozen=True)
class Claimed:
    """A row this consumer now holds in 'sending', with what the send needs."""

    id: int
    idempotency_key: str
    reminder_id: str | None
    channel: str
    provider: str
    occurrence_at: datetime
    urgent: bool
    attempts: int  # the attempt number this claim owns (the fence for the outcome write)
    round_start: int  # attempts before the current round (a replay starts a new round)
    run_id: int | None
    prior_state: str
    destination: str | None
    payload: dict[str, Any] | None
    payload_version: int | None
    active: bool
    stale_after_seconds: float | None
    send_stale: bool
    destination_disabled: bool

    @property
    def attempt_in_round(self) -> int:
        return self.attempts - self.round_start


@dataclass(frozen=True)
class Unclaimable:
    """A row a claim did not take, and why (its state, with the database's clock)."""

    id: int
    state: State
    next_attempt_at: datetime | None
    lease_expires_at: datetime | None
    now: datetime
    attempts: int = 0
    last_status: int | None = None
    last_error: str | None = None
    # 'dead', but its dead letter was never confirmed (the consumer died in between).
    dead_letter_missing: bool = False


@dataclass(frozen=True)
class Attempt:
    """What one attempt did, for ``delivery_attempts``."""

    outcome: str  # accepted | retry | throttled | rejected | skipped
    http_status: int | None = None
    latency_ms: float | None = None
    error: str | None = None
    response_excerpt: str | None = None
    payload_version: int | None = None
    started_at: datetime | None = None
    stale: bool = False  # sent although older than the reminder's stale_after


@dataclass(frozen=True)
class Completion:
    """The new state of a claimed row after its attempt."""

    id: int
    attempt: int
    state: State
    next_attempt_at: datetime | None = None
    status: int | None = None
    error: str | None = None
    receipt: str | None = None
    skip_reason: str | None = None
    record: Attempt | None = None


_NO_RECORD = Attempt(outcome="")  # a completion without an attempt row


def _clip(text: str | None, limit: int) -> str | None:
    return None if text is None else text[:limit]


async def claim(
    conn: Connection, ids: Sequence[int], lease_seconds: float
) -> tuple[dict[int, Claimed], dict[int, Unclaimable]]:
    """Claim many rows at once; return those taken and, for the rest, why not.

    The claim is one statement (atomic on its own); the look-up of the rest runs after it,
    so it sees the claim's result.
    """
    rows = await conn.fetch(q("claim"), list(ids), lease_seconds)
    claimed = {r["id"]: Claimed(**dict(r)) for r in rows}
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
            )
    return claimed, others


async def mark_dead_lettered(executor: Executor, delivery_id: int, attempt: int) -> None:
    """Record that the dead letter of this row's death was confirmed by the broker."""
    await executor.execute(q("mark_dead_lettered"), delivery_id, attempt)


async def complete(conn: Connection, completions: Sequence[Completion]) -> set[int]:
    """Write outcomes and their attempt rows in one statement; return the ids written.

    An id missing from the result lost its lease to another claim: its attempt row is
    still recorded (the send happened), its state is the other claimant's to write.
    """
    if not completions:
        return set()
    records = [c.record or _NO_RECORD for c in completions]
    rows = await conn.fetch(
        q("complete"),
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
    )
    return {r["id"] for r in rows}


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


async def insert_deliveries(
    conn: Connection, rows: Sequence[NewDelivery], run_id: int
) -> list[tuple[int, bool, State]]:
    """Insert owed occurrences; existing keys insert nothing. Returns (id, urgent, state)."""
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
    return [(r["id"], r["urgent"], State(r["state"])) for r in result]


async def mark_queued(executor: Executor, ids: Sequence[int]) -> None:
    """pending -> queued, for ids whose publish the broker confirmed."""
    if ids:
        await executor.execute(q("mark_queued"), list(ids))


async def select_pending(executor: Executor, after_id: int, limit: int) -> list[tuple[int, bool]]:
    """A page of pending rows (id, urgent) after ``after_id``."""
    rows = await executor.fetch(q("select_pending"), after_id, limit)
    return [(r["id"], r["urgent"]) for r in rows]


async def select_rescue(
    executor: Executor, overdue_seconds: float, limit: int
) -> list[tuple[int, bool]]:
    """Rows whose message is presumed lost (see the query), oldest first."""
    rows = await executor.fetch(q("select_rescue"), overdue_seconds, limit)
    return [(r["id"], r["urgent"]) for r in rows]


async def release(executor: Executor, delivery_id: int, attempt: int, retry_at: datetime) -> bool:
    """sending -> retrying without counting the attempt (the send was deferred)."""
    return await executor.fetchval(q("release"), delivery_id, attempt, retry_at) is not None


async def touch_published(executor: Executor, ids: Sequence[int]) -> None:
    if ids:
        await executor.execute(q("touch_published"), list(ids))
