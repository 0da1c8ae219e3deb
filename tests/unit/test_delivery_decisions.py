"""The decisions of ``Deliverer.deliver`` that need no server: the destination slot (a
context manager, with the circuit breaker on a clock the test moves), the lease checked
after the waits, what an outcome tells the destinations registry, and what becomes of the
message once the outcome is written. The ledger-backed steps keep their integration tests
(``tests/integration/test_destinations.py``, ``test_fenced_outcomes.py``, ...)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from consumer import decisions, gate, isolation, registry
from consumer.channels.base import Outcome, OutcomeKind
from consumer.dispositions import Ack, DeadLetter, Redelay
from consumer.retry import Action, Decision
from service import amqp, telemetry
from service.ledger import Attempt, Claimed, Completion, SendFacts, State, Target

NOW = datetime(2026, 3, 1, 6, 0, tzinfo=UTC)
URL = "https://partner.example/hook"
KEY = isolation.destination_key("webhook", "acme", URL)
ROW = Claimed(
    id=7,
    idempotency_key="reminder:r1:2026-03-01T06:00:00Z:webhook",
    reminder_id="r1",
    channel="webhook",
    provider="acme",
    occurrence_at=NOW,
    urgent=False,
    attempts=3,
    round_start=0,
    run_id=11,
    prior_state="queued",
    destination=URL,
    payload={"text": "hi"},
    payload_version=1,
    facts=SendFacts(
        active=True,
        age_seconds=1.0,
        stale_after_seconds=None,
        send_stale=False,
        destination_disabled=False,
    ),
)
ACCEPTED = Outcome(OutcomeKind.ACCEPTED, http_status=200)
FAILED = Outcome(OutcomeKind.RETRY, http_status=503, error="http 503")
TIMEOUT = Outcome(OutcomeKind.RETRY, error="timeout")
REJECTED = Outcome(OutcomeKind.REJECTED, http_status=400, error="http 400")
THROTTLED = Outcome(OutcomeKind.THROTTLED, http_status=429, retry_after_seconds=7.0)
GONE = Outcome(OutcomeKind.REJECTED, http_status=410, disable_destination=True)


class Clock:
    """Monotonic seconds the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _guard(clock: Clock, *, share: int = 2, threshold: int = 2) -> isolation.DestinationGuard:
    return isolation.DestinationGuard(
        max_in_flight=share, failure_threshold=threshold, cooldown_seconds=30.0, monotonic=clock
    )


def _slot(guard: isolation.DestinationGuard) -> gate.Slot:
    assert guard.try_take_slot(KEY).admitted
    return gate.Slot(guard, KEY, None)


def _free_slots(guard: isolation.DestinationGuard) -> int:
    """How many slots of KEY can be taken now (each taken one is given back)."""
    taken = 0
    while guard.try_take_slot(KEY).admitted:
        taken += 1
    for _ in range(taken):
        guard.return_slot(KEY, failed=None)
    return taken


# ------------------------------------------------------------------ the slot


def test_a_slot_answered_is_back_at_once_and_leaving_the_block_does_not_return_it_again() -> None:
    guard = _guard(Clock())
    with _slot(guard) as slot:
        assert _free_slots(guard) == 1
        slot.answered(ACCEPTED)
        assert _free_slots(guard) == 2  # back before the block ends
    assert _free_slots(guard) == 2  # not a third slot: returned exactly once


def test_failed_requests_open_the_circuit_until_the_cooldown_passes() -> None:
    clock = Clock()
    guard = _guard(clock, threshold=2)
    for outcome in (FAILED, TIMEOUT):
        with _slot(guard) as slot:
            slot.answered(outcome)
    refused = guard.check_circuit(KEY)
    assert (refused.admitted, refused.reason, refused.retry_after_seconds) == (
        False,
        "circuit open",
        30.0,
    )
    clock.now += 29.9
    assert not guard.check_circuit(KEY).admitted
    clock.now += 0.1
    assert guard.check_circuit(KEY).admitted  # half-open: one probe may go


@pytest.mark.parametrize("answer", [ACCEPTED, REJECTED, THROTTLED, GONE])
def test_any_answer_but_a_timeout_or_5xx_ends_a_failure_run(answer: Outcome) -> None:
    guard = _guard(Clock(), threshold=2)
    for outcome in (FAILED, answer, FAILED):
        with _slot(guard) as slot:
            slot.answered(outcome)
    assert guard.check_circuit(KEY).admitted  # one failure since the answer: still closed


def test_a_slot_left_without_an_answer_goes_back_unused_and_tells_the_circuit_nothing() -> None:
    guard = _guard(Clock(), threshold=2)
    with _slot(guard) as slot:
        slot.answered(FAILED)
    with _slot(guard):
        pass  # not sent after all (the last check said no)
    assert _free_slots(guard) == 2
    with _slot(guard) as slot:
        slot.answered(FAILED)
    assert not guard.check_circuit(KEY).admitted  # the unused one did not reset the run


def test_an_error_inside_the_block_gives_the_slot_back_and_goes_on() -> None:
    guard = _guard(Clock(), share=1)
    with pytest.raises(RuntimeError), _slot(guard):
        raise RuntimeError("request cancelled")
    assert _free_slots(guard) == 1


async def test_an_answered_slot_goes_to_the_send_waiting_for_it() -> None:
    guard = isolation.DestinationGuard(
        max_in_flight=1, failure_threshold=3, cooldown_seconds=30.0, max_wait_seconds=5.0
    )
    with _slot(guard) as slot:
        waiting = asyncio.ensure_future(guard.take_slot(KEY))
        await asyncio.sleep(0)
        assert not waiting.done()
        slot.answered(ACCEPTED)
        assert (await waiting).admitted
    guard.return_slot(KEY, failed=None)
    assert _free_slots(guard) == 1


async def test_admit_gives_the_slot_back_when_the_waits_ate_the_lease() -> None:
    clock = Clock()
    guard = _guard(clock, share=1)
    checks = gate.Gate(
        guard=guard,
        budgets=None,
        metrics=telemetry.noop(),
        lease_seconds=30.0,
        send_timeout_seconds=10.0,
        budget_max_wait_seconds=5.0,
        monotonic=clock,
    )
    stop = asyncio.Event()
    # Claimed 20 s ago: 10 s of lease left is not more than a request may take.
    late = await checks.admit(ROW, claimed_at=clock.now - 20.0, no_new_requests=stop)
    assert late == gate.Defer("lease too short after waiting", 1.0)
    assert _free_slots(guard) == 1
    fresh = await checks.admit(ROW, claimed_at=clock.now - 19.0, no_new_requests=stop)
    assert isinstance(fresh, gate.Slot)
    fresh.release()
    stop.set()  # shutdown: no request may start any more
    assert await checks.admit(ROW, claimed_at=clock.now, no_new_requests=stop) == gate.Stopped()
    assert _free_slots(guard) == 1


# ------------------------------------------------------------------ the registry


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (GONE, registry.Lesson.GONE),
        (FAILED, registry.Lesson.FAILED),
        (TIMEOUT, registry.Lesson.FAILED),
        (REJECTED, registry.Lesson.FAILED),  # the receiver refused it: its answer
        (decisions.refused("destination refused"), registry.Lesson.NOTHING),  # ours, no request
        (THROTTLED, registry.Lesson.NOTHING),
        (ACCEPTED, registry.Lesson.NOTHING),  # no streak to end: no write on the hot path
    ],
)
def test_what_an_outcome_tells_the_registry(outcome: Outcome, expected: registry.Lesson) -> None:
    assert registry.lesson(ROW, outcome, seen_failing=False) is expected


def test_a_success_ends_a_streak_the_row_read_or_this_process_saw() -> None:
    streaking = replace(ROW, target=Target(failure_streak=2))
    assert registry.lesson(streaking, ACCEPTED, seen_failing=False) is registry.Lesson.SUCCEEDED
    assert registry.lesson(ROW, ACCEPTED, seen_failing=True) is registry.Lesson.SUCCEEDED


@pytest.mark.parametrize("outcome", [GONE, FAILED, ACCEPTED])
def test_only_webhook_destinations_are_in_the_registry(outcome: Outcome) -> None:
    email = replace(ROW, channel="email", destination="someone@example.org")
    assert registry.lesson(email, outcome, seen_failing=True) is registry.Lesson.NOTHING
    unknown = replace(ROW, destination=None)
    assert registry.lesson(unknown, outcome, seen_failing=True) is registry.Lesson.NOTHING


# ------------------------------------------------------------------ the message after


def _completion(state: State, error: str | None = None) -> Completion:
    return Completion(ROW.id, ROW.attempts, state, error=error, record=Attempt(outcome="x"))


def test_a_written_retry_parks_the_message_in_its_lane_for_the_policy_delay() -> None:
    retry = Decision(Action.RETRY, delay_seconds=4.0)
    after = decisions.message_after(ROW, FAILED, retry, _completion(State.RETRYING), written=True)
    assert after == Redelay(amqp.BULK, 4.0)
    urgent = replace(ROW, urgent=True)
    assert decisions.message_after(
        urgent, FAILED, retry, _completion(State.RETRYING), written=True
    ) == Redelay(amqp.URGENT, 4.0)


def test_a_written_dead_row_sends_its_message_to_the_dead_letters_with_why() -> None:
    dead = Decision(Action.DEAD, reason="rejected")
    after = decisions.message_after(
        ROW, REJECTED, dead, _completion(State.DEAD, "rejected: http 400"), written=True
    )
    assert after == DeadLetter(
        "rejected: http 400", dead_row=(7, 3), headers={"x-relay-last-status": 400}
    )
    no_error = decisions.message_after(ROW, TIMEOUT, dead, _completion(State.DEAD), written=True)
    assert no_error == DeadLetter("dead", dead_row=(7, 3), headers={"x-relay-last-status": 0})


@pytest.mark.parametrize(
    "decision",
    [Decision(Action.DELIVERED), Decision(Action.RETRY, delay_seconds=4.0), Decision(Action.DEAD)],
)
def test_a_write_fenced_out_acks_the_message_whatever_was_decided(decision: Decision) -> None:
    fenced = decisions.message_after(ROW, FAILED, decision, _completion(State.DEAD), written=False)
    assert fenced == Ack()  # another claim owns the row; its own message carries it


def test_a_written_delivery_acks_the_message() -> None:
    delivered = decisions.message_after(
        ROW, ACCEPTED, Decision(Action.DELIVERED), _completion(State.DELIVERED), written=True
    )
    assert delivered == Ack()
