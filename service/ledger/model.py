"""The ledger's vocabulary: the delivery states, the rows a transition reads and writes, and
what every transition of the package shares (the connection types, the deadlock retry).

No statement runs here; ``service.ledger``'s modules run them.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import asyncpg

from service import db

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
