"""The ledger state machine: one typed function per transition over ``deliveries``.

Each function runs one named statement from ``sql/queries.sql``. A transition that
finds its row in another state does nothing and says so (an empty result), because
"someone else won" is a normal answer in a system with redelivery and rescue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import asyncpg

from service import db
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
    ACCEPTED = "accepted"  # e-mail, SMS: the provider took it; no receipt says more yet
    DELIVERED = "delivered"  # a webhook's 2xx; e-mail, SMS: a receipt says it arrived
    BOUNCED = "bounced"  # e-mail, SMS: a receipt says it did not arrive
    DEAD = "dead"
    SKIPPED = "skipped"


FINAL_STATES = frozenset(
    {State.ACCEPTED, State.DELIVERED, State.BOUNCED, State.DEAD, State.SKIPPED}
)
# States whose row still owes a send (a message for it should exist or be published).
OPEN_STATES = frozenset({State.PENDING, State.QUEUED, State.SENDING, State.RETRYING})


def operator_dead_error(reason: str | None) -> str:
    """``last_error`` of a row an operator dead-lettered (``relay runs dead-letter``)."""
    return f"dead-lettered by an operator: {reason or 'no reason'}"[:500]


def outbox_key(key: str) -> str:
    """The idempotency key of an outbox intent, namespaced apart from schedule keys."""
    return f"outbox:{key}"


@dataclass(frozen=True)
class SendFacts:
    """What decides whether a claimed row may be sent now, as the ledger says."""

    active: bool  # the reminder is not cancelled (outbox intents always are)
    age_seconds: float  # since the occurrence, on the database's clock
    stale_after_seconds: float | None
    send_stale: bool
    destination_disabled: bool
    provider_paused_seconds: float = 0.0
    run_held: bool = False  # its publish run is held by an operator (`relay runs hold`)
    # An operator cancelled ('cancel') or dead-lettered ('dead-letter') its run while its
    # request was on the wire: it is never sent again (``stop_reason``: the action's why).
    stop_action: str | None = None
    stop_reason: str | None = None
    suppressed: bool = False  # its address is on the suppression list of its channel


@dataclass(frozen=True)
class Target:
    """What a webhook row's destination asks of its request, read with the claim."""

    secrets: tuple[str, ...] = field(default=(), repr=False)  # valid, encrypted, newest first
    envelope: bool = False  # the Standard Webhooks event envelope
    event_type: str | None = None  # the envelope's type (None: the default)
    failure_streak: int = 0  # the destination's failed attempts in a row, at the claim


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
    facts: SendFacts
    target: Target = Target()

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
    # 'pending'/'queued' and not due yet: how long until it is (database clock).
    early_seconds: float = 0.0
    # The overdue sweep republished its message at least once (a duplicate is then harmless
    # and expected: the original came after all).
    republished: bool = False


@dataclass(frozen=True)
class Attempt:
    """What one attempt did, for ``delivery_attempts``."""

    outcome: str  # accepted | retry | throttled | rejected | skipped
    http_status: int | None = None
    latency_ms: float | None = None
    error: str | None = None
    response_excerpt: str | None = None
    payload_version: int | None = None
    started_at: datetime | None = None  # taken right before the request went out
    stale: bool = False  # sent although older than the reminder's stale_after
    possibly_delivered: bool | None = None  # False: no byte can have reached the receiver
    provider_message_id: str | None = None  # the provider's id of the message it sent


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
_CONFLICT_RETRIES = 3

T = TypeVar("T")


async def retry_on_conflict(statement: Callable[[], Awaitable[T]]) -> T:
    """Run a statement that locks several rows; again if it lost a deadlock.

    Every such statement locks in id order, so a deadlock needs an outside party (an
    operator's ad-hoc SQL); a few quick retries resolve it instead of failing the caller.
    """
    for attempt in range(_CONFLICT_RETRIES):
        try:
            return await statement()
        except db.CONFLICT:
            if attempt == _CONFLICT_RETRIES - 1:
                raise
            await asyncio.sleep(0.01 * (attempt + 1) * (1 + random.random()))
    raise AssertionError("unreachable")


def _clip(text: str | None, limit: int) -> str | None:
    return None if text is None else text[:limit]


def send_facts(r: asyncpg.Record) -> SendFacts:
    """The send facts of a row read by the claim or the last check."""
    return SendFacts(
        active=r["active"],
        age_seconds=r["age_seconds"],
        stale_after_seconds=r["stale_after_seconds"],
        send_stale=r["send_stale"],
        destination_disabled=r["destination_disabled"],
        provider_paused_seconds=r.get("provider_paused_seconds") or 0.0,
        run_held=bool(r.get("run_held")),
        stop_action=r.get("stop_action"),
        stop_reason=r.get("stop_reason"),
        suppressed=bool(r.get("suppressed")),
    )


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


async def cancel_reminder(executor: Executor, reminder_id: str) -> bool:
    """An operator's cancel: no new occurrences, and its queued sends are skipped at send
    time (the consumer reads it again right before each request). Recorded as
    ``cancelled``, so enabling its destination never revives it. False if there is no such
    reminder or it already was cancelled."""
    return await executor.fetchval(q("cancel_reminder"), reminder_id) is not None


async def mark_queued(executor: Executor, ids: Sequence[int]) -> None:
    """pending -> queued, for ids whose publish the broker confirmed."""
    if ids:
        await retry_on_conflict(lambda: executor.execute(q("mark_queued"), list(ids)))


async def select_pending(
    executor: Executor, after_id: int, limit: int
) -> list[tuple[int, bool, datetime]]:
    """A page of pending rows (id, urgent, occurrence_at) after ``after_id``."""
    rows = await executor.fetch(q("select_pending"), after_id, limit)
    return [(r["id"], r["urgent"], r["occurrence_at"]) for r in rows]


async def reset_for_replay(executor: Executor, ids: Sequence[int]) -> list[tuple[int, bool]]:
    """dead -> pending for another round of attempts; (id, urgent) of the rows reset."""
    if not ids:
        return []
    rows = await retry_on_conflict(lambda: executor.fetch(q("reset_for_replay"), list(ids)))
    return [(r["id"], r["urgent"]) for r in rows]


@dataclass(frozen=True)
class ReplayFilter:
    """Which rows a ledger replay selects (None: any)."""

    states: tuple[State, ...] = (State.DEAD,)
    since: datetime | None = None
    until: datetime | None = None
    run_id: int | None = None
    reminder_id: str | None = None
    provider: str | None = None
    channel: str | None = None
    key: str | None = None
    last_status: int | None = None


async def select_for_replay(
    executor: Executor, selection: ReplayFilter, after_id: int, limit: int
) -> list[tuple[int, State, bool]]:
    """One page (id, state, urgent) of rows matching ``selection``, after ``after_id``."""
    f = selection
    filters = (f.since, f.until, f.run_id, f.reminder_id, f.provider, f.channel, f.key)
    states = [s.value for s in f.states]
    rows = await executor.fetch(
        q("replay_select"), states, *filters, f.last_status, after_id, limit
    )
    return [(r["id"], State(r["state"]), r["urgent"]) for r in rows]


async def replay_started(
    executor: Executor, source: str, operator: str, filters: dict[str, Any]
) -> int:
    """Record who started a replay, from where and with which filters; its id."""
    return int(await executor.fetchval(q("replay_started"), source, operator, filters))


async def replay_finished(executor: Executor, replay_id: int, selected: int, replayed: int) -> None:
    """Record how a replay ended."""
    await executor.execute(q("replay_finished"), replay_id, selected, replayed)


async def state_of(executor: Executor, delivery_id: int) -> tuple[State, bool] | None:
    """(state, urgent) of one row, or None if there is no such row."""
    row = await executor.fetchrow(q("delivery_lane"), delivery_id)
    return None if row is None else (State(row["state"]), row["urgent"])
