"""Pure decisions about one delivery: may it be sent now, what to write after its attempt,
and what becomes of its message (after the attempt, or when its row cannot be claimed).

No I/O and no clock: the worker reads the facts (from the claim, and again right before
the request) and the time, and these functions say what follows. Every branch is
unit-tested.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from consumer.channels.base import Outcome, OutcomeKind
from consumer.dispositions import Ack, DeadLetter, Disposition, Redelay
from consumer.retry import Action, Decision
from service import amqp, ledger
from service.ledger import Claimed, Completion, SendFacts, State, Unclaimable
from service.receipt_events import RECEIPT_CHANNELS


@dataclass(frozen=True)
class Send:
    """Send it; ``stale`` when older than its ``stale_after`` but ``send_stale`` is set."""

    stale: bool = False


@dataclass(frozen=True)
class Skip:
    """Do not send, on purpose: the row ends 'skipped' with this reason."""

    reason: str  # cancelled | stale | suppressed


@dataclass(frozen=True)
class Refuse:
    """The destination is refused: the attempt ends as rejected, the row 'dead'."""

    error: str


@dataclass(frozen=True)
class Kill:
    """An operator dead-lettered the run while this row was claimed: it ends 'dead'
    (replayable) without a request, and its dead letter is published."""

    error: str


@dataclass(frozen=True)
class Hold:
    """Not now: give the claim back and try again after ``seconds``."""

    reason: str
    seconds: float


Verdict = Send | Skip | Refuse | Hold | Kill

DISABLED_DESTINATION = "destination disabled"
# How long a delivery to a disabled destination is parked by default (s).
DISABLED_HOLD_SECONDS = 60.0


RUN_HELD = "run held"


def verdict(
    facts: SendFacts,
    *,
    has_destination: bool,
    hold_seconds: float = DISABLED_HOLD_SECONDS,
    held_recheck_seconds: float = 30.0,
    budget_obeys_pause: bool = False,
) -> Verdict:
    """Whether a claimed row may be sent, given what the ledger says about it now.

    An operator's cancel or dead-letter of the run comes first of all: it is the word that
    ends a hold. A row of a held run is parked next: an operator holding a run wants none
    of its rows to change until the release (or a cancel or dead-letter of the run). A row
    for a disabled destination is held (``hold_seconds``), never refused: it goes out
    once the destination is enabled again. ``budget_obeys_pause``: a throttle pause is
    waited out by the provider's rate budget (its claim, before the budget wait), not
    parked for."""
    if facts.stop_action == "cancel":
        return Skip("cancelled")
    if facts.stop_action is not None:
        return Kill(ledger.operator_dead_error(facts.stop_reason))
    if facts.run_held:
        return Hold(RUN_HELD, held_recheck_seconds)
    if not facts.active or not has_destination:
        return Skip("cancelled")
    if facts.suppressed:  # a hard bounce, a complaint or an operator said: never this address
        return Skip("suppressed")
    stale = facts.stale_after_seconds is not None and facts.age_seconds > facts.stale_after_seconds
    if stale and not facts.send_stale:
        return Skip("stale")
    if facts.destination_disabled:
        return Hold(DISABLED_DESTINATION, hold_seconds)
    if facts.provider_paused_seconds > 0 and not budget_obeys_pause:
        return Hold("provider paused", facts.provider_paused_seconds)
    return Send(stale=stale)


def skipped(row: Claimed, reason: str) -> Completion:
    """The completion of a row not sent on purpose (cancelled, stale)."""
    return Completion(
        id=row.id,
        attempt=row.attempts,
        state=State.SKIPPED,
        skip_reason=reason,
        record=ledger.Attempt(outcome="skipped", error=reason),
    )


def reconciled(row: Claimed, message_id: str, started_at: datetime) -> Completion:
    """The completion of a row whose message the provider already had (a lost attempt's):
    accepted, under that message's id, with no request made."""
    return Completion(
        row.id,
        row.attempts,
        State.ACCEPTED,
        receipt=message_id,
        record=ledger.Attempt(
            outcome="reconciled",
            payload_version=row.payload_version,
            started_at=started_at,
            latency_ms=0.0,
            possibly_delivered=False,
            provider_message_id=message_id,
        ),
    )


def killed(row: Claimed, error: str) -> Completion:
    """The completion of a row an operator dead-lettered while it was claimed."""
    return Completion(
        id=row.id,
        attempt=row.attempts,
        state=State.DEAD,
        error=error,
        record=ledger.Attempt(outcome="skipped", error=error, possibly_delivered=False),
    )


def refused(error: str) -> Outcome:
    """The outcome of an attempt refused before any request was made."""
    return Outcome(OutcomeKind.REJECTED, error=error, possibly_delivered=False)


def attempt_record(
    row: Claimed,
    outcome: Outcome,
    *,
    started_at: datetime | None,
    latency_seconds: float,
    stale: bool,
) -> ledger.Attempt:
    """The ``delivery_attempts`` row of one attempt."""
    return ledger.Attempt(
        outcome=outcome.kind.value,
        http_status=outcome.http_status,
        latency_ms=latency_seconds * 1000,
        error=outcome.error,
        response_excerpt=outcome.response_excerpt,
        payload_version=row.payload_version,
        started_at=started_at,
        stale=stale,
        possibly_delivered=outcome.possibly_delivered,
        provider_message_id=outcome.message_id,
    )


def after_attempt(
    row: Claimed,
    outcome: Outcome,
    decision: Decision,
    record: ledger.Attempt,
    *,
    now: datetime,
) -> Completion:
    """The new state of ``row`` after its attempt, as the retry policy decided. A provider
    that sends receipts (e-mail, SMS) has only accepted it: a receipt says more later."""
    if decision.action is Action.DELIVERED:
        return Completion(
            row.id,
            row.attempts,
            State.ACCEPTED if row.channel in RECEIPT_CHANNELS else State.DELIVERED,
            status=outcome.http_status,
            receipt=outcome.receipt,
            record=record,
        )
    if decision.action is Action.RETRY:
        assert decision.delay_seconds is not None
        return Completion(
            row.id,
            row.attempts,
            State.RETRYING,
            next_attempt_at=now + timedelta(seconds=decision.delay_seconds),
            status=outcome.http_status,
            error=outcome.error,
            record=record,
        )
    reason = decision.reason or "dead"
    return Completion(
        row.id,
        row.attempts,
        State.DEAD,
        status=outcome.http_status,
        error=f"{reason}: {outcome.error}" if outcome.error else reason,
        record=record,
    )


def message_after(
    row: Claimed,
    outcome: Outcome,
    decision: Decision,
    completion: Completion,
    *,
    written: bool,
) -> Disposition:
    """What becomes of the message once its attempt's outcome was written (``written``:
    False when another claim fenced this one out; that claim's message carries the row).
    A retry parks it for the policy's delay in the row's lane, a dead row sends it to the
    dead-letter exchange with why, anything else acks it."""
    if not written:
        return Ack()
    if decision.action is Action.RETRY:
        assert decision.delay_seconds is not None
        return Redelay(amqp.lane_of(row.urgent), decision.delay_seconds)
    if decision.action is Action.DEAD:
        return DeadLetter(
            completion.error or "dead",
            dead_row=(row.id, row.attempts),
            headers={"x-relay-last-status": outcome.http_status or 0},
        )
    return Ack()


def message_for_unclaimable(row: Unclaimable, lane: str) -> Disposition:
    """What becomes of a message whose row the claim did not take (``row.now`` is the
    database's clock). A dead row whose dead letter was never confirmed: this message
    carries it, from the ledger. A final row: a redelivery or a rescue's duplicate, acked
    and never sent again. Otherwise the row is held by a live claim (``sending``), waits
    for its retry time (``retrying``) or is not due yet: the message is parked until then
    rather than dropped, so a lost retry message is moot and an early one is never sent
    before its time."""
    if row.dead_letter_missing:
        return DeadLetter(
            row.last_error or "dead",
            dead_row=(row.id, row.attempts),
            headers={"x-relay-last-status": row.last_status or 0},
        )
    if row.state in ledger.FINAL_STATES:
        return Ack()
    until = row.lease_expires_at if row.state is State.SENDING else row.next_attempt_at
    remaining = max((until - row.now).total_seconds(), 0.0) if until else 0.0
    return Redelay(lane, max(remaining, row.early_seconds))
