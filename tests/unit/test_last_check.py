"""The order of one delivery's last steps: every wait, then the last check, then the request
with nothing in between. The real ``Deliverer`` and ``Gate``; the ledger, the rate budget
and the channel are stand-ins the test steers (no I/O), so a cancel can be committed
exactly inside a chosen wait."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from consumer import gate, isolation, store
from consumer.channels.base import Outcome, OutcomeKind, SendRequest
from consumer.delivery import Deliverer
from consumer.dispositions import Ack, DeadLetter, Disposition, Redelay
from consumer.retry import RetryPolicy
from service import telemetry
from service.ledger import Claimed, Completion, SendFacts, State
from service.ledger.lastcheck import LastCheck

NOW = datetime(2026, 3, 1, 6, 0, tzinfo=UTC)
FRESH = SendFacts(
    active=True,
    age_seconds=1.0,
    stale_after_seconds=None,
    send_stale=False,
    destination_disabled=False,
)
ROW = Claimed(
    id=7,
    idempotency_key="reminder:r1:2026-03-01T06:00:00Z:webhook",
    reminder_id="r1",
    channel="webhook",
    provider="acme",
    occurrence_at=NOW,
    urgent=False,
    attempts=1,
    round_start=0,
    run_id=11,
    prior_state="queued",
    destination="https://partner.example/hook",
    payload={"text": "hi"},
    payload_version=1,
    facts=FRESH,
)


class Clock:
    """Monotonic seconds the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Ledger:
    """The consumer's statements, answered from what the test says the row is now."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.calls: list[str] = []
        self.row = LastCheck(
            passed=True,
            state=State.SENDING,
            attempts=ROW.attempts,
            lease_left_seconds=100.0,
            dead_letter_missing=False,
            last_error=None,
            facts=FRESH,
        )
        self.check_seconds = 0.0  # how long each last check takes (moves the clock)
        self.completions: list[Completion] = []

    async def last_check(self, delivery_id: int, attempt: int) -> LastCheck:
        self.calls.append("last_check")
        self.clock.now += self.check_seconds
        return self.row

    def stamp(self, row: Claimed) -> store.Stamp:
        return store.Stamp(self, row.id, row.attempts)  # type: ignore[arg-type]

    async def undo_check(self, delivery_id: int, attempt: int) -> None:
        self.calls.append("undo_check")

    async def complete(self, completion: Completion) -> bool:
        self.calls.append(f"complete:{completion.state.value}")
        self.completions.append(completion)
        return True

    async def release(self, delivery_id: int, attempt: int, retry_at: Any) -> bool:
        self.calls.append("release")
        return True


class Budget:
    """A rate budget whose grants the test hands out one by one."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.grants: asyncio.Queue[float] = asyncio.Queue()
        self.tokens_at_hand = 0  # taken without waiting
        self.hand_deadline = 0.0
        self.limited = True
        self.paused = 0.0  # this process's own throttle pause

    def rate_limited(self, provider: str) -> bool:
        return self.limited

    def paused_seconds(self, provider: str) -> float:
        return self.paused

    def at_hand(self, provider: str) -> bool:
        return self.tokens_at_hand > 0

    async def acquire(self, provider: str, *, urgent: bool, max_wait_seconds: float) -> float:
        if self.tokens_at_hand > 0:
            self.tokens_at_hand -= 1
            self.calls.append("budget_take")
            return self.hand_deadline
        self.calls.append("budget_wait")
        return await self.grants.get()


class Channel:
    name = "webhook"

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def send(self, request: SendRequest) -> Outcome:
        self.calls.append("request")
        return Outcome(OutcomeKind.ACCEPTED, http_status=200)

    async def close(self) -> None:
        pass


def _deliverer(clock: Clock, ledger: Ledger, budget: Budget) -> Deliverer:
    guard = isolation.DestinationGuard(
        max_in_flight=4, failure_threshold=3, cooldown_seconds=30.0, monotonic=clock
    )
    metrics = telemetry.noop()
    checks = gate.Gate(
        guard=guard,
        budgets=budget,  # type: ignore[arg-type]
        metrics=metrics,
        lease_seconds=120.0,
        send_timeout_seconds=10.0,
        budget_max_wait_seconds=30.0,
        monotonic=clock,
    )

    class Wall:
        def now(self) -> datetime:
            return NOW

    return Deliverer(
        store=ledger,  # type: ignore[arg-type]
        gate=checks,
        channels={"webhook": Channel(ledger.calls)},  # type: ignore[dict-item]
        policy=RetryPolicy(),
        metrics=metrics,
        clock=Wall(),
        monotonic=clock,
    )


async def _deliver(deliverer: Deliverer, clock: Clock) -> Disposition:
    return await deliverer.deliver(ROW, claimed_at=clock(), no_new_requests=asyncio.Event())


async def test_a_valid_token_goes_from_the_last_check_straight_to_the_request() -> None:
    clock = Clock()
    ledger = Ledger(clock)
    budget = Budget(ledger.calls)
    budget.grants.put_nowait(clock.now + 0.06)
    disposition = await _deliver(_deliverer(clock, ledger, budget), clock)
    # The claim's stamp is taken back for the wait; the check after it stamps again.
    assert ledger.calls == [
        "undo_check",
        "budget_wait",
        "last_check",
        "request",
        "complete:delivered",
    ]
    assert disposition == Ack()


async def test_a_cancel_committed_during_the_second_budget_wait_is_obeyed() -> None:
    """The token runs out during the last check; the new one must be waited for. The
    check's stamp is taken back for that wait, an operator's cancel commits inside it (the
    row is moved, as `relay runs cancel` moves a claimed row without a stamp), and the
    check after the wait finds it: no request."""
    clock = Clock()
    ledger = Ledger(clock)
    budget = Budget(ledger.calls)
    ledger.check_seconds = 0.1  # longer than the token lives
    budget.grants.put_nowait(clock.now + 0.06)
    delivering = asyncio.create_task(_deliver(_deliverer(clock, ledger, budget), clock))
    await _second_wait(budget, ledger)
    assert ledger.calls == [
        "undo_check",
        "budget_wait",
        "last_check",
        "undo_check",
        "budget_wait",
    ]

    ledger.row = replace(ledger.row, passed=False, state=State.SKIPPED)  # the cancel commits
    budget.grants.put_nowait(clock.now + 0.06)  # the wait ends with a valid token
    disposition = await asyncio.wait_for(delivering, 5)

    assert ledger.calls == [
        "undo_check",
        "budget_wait",
        "last_check",
        "undo_check",
        "budget_wait",
        "last_check",
    ]
    assert "request" not in ledger.calls and disposition == Ack()


async def test_a_dead_letter_committed_during_the_second_budget_wait_carries_its_letter() -> None:
    clock = Clock()
    ledger = Ledger(clock)
    budget = Budget(ledger.calls)
    ledger.check_seconds = 0.1
    budget.grants.put_nowait(clock.now + 0.06)
    delivering = asyncio.create_task(_deliver(_deliverer(clock, ledger, budget), clock))
    await _second_wait(budget, ledger)
    error = "dead-lettered by an operator: bad template"
    ledger.row = replace(
        ledger.row, passed=False, state=State.DEAD, dead_letter_missing=True, last_error=error
    )
    budget.grants.put_nowait(clock.now + 0.06)
    disposition = await asyncio.wait_for(delivering, 5)
    assert "request" not in ledger.calls
    assert isinstance(disposition, DeadLetter)
    assert (disposition.reason, disposition.dead_row) == (error, (ROW.id, ROW.attempts))


async def test_a_stop_asked_while_on_the_wire_is_obeyed_at_the_next_check() -> None:
    """The stamp was still there when the operator committed (the row was on the wire for
    him): the row is marked instead of moved, and the next check ends it as the action
    says, through the consumer's own fenced write."""
    clock = Clock()
    ledger = Ledger(clock)
    budget = Budget(ledger.calls)
    ledger.check_seconds = 0.1
    budget.grants.put_nowait(clock.now + 0.06)
    delivering = asyncio.create_task(_deliver(_deliverer(clock, ledger, budget), clock))
    await _second_wait(budget, ledger)
    ledger.row = replace(
        ledger.row, passed=False, facts=replace(FRESH, stop_action="cancel", stop_reason="x")
    )
    budget.grants.put_nowait(clock.now + 0.06)
    disposition = await asyncio.wait_for(delivering, 5)
    assert ledger.calls[-2:] == ["last_check", "complete:skipped"]
    assert ledger.completions[-1].skip_reason == "cancelled"
    assert "request" not in ledger.calls and disposition == Ack()


async def test_a_check_that_outlives_its_token_with_a_new_one_after_the_wait_sends() -> None:
    clock = Clock()
    ledger = Ledger(clock)
    budget = Budget(ledger.calls)
    ledger.check_seconds = 0.1
    budget.grants.put_nowait(clock.now + 0.06)
    delivering = asyncio.create_task(_deliver(_deliverer(clock, ledger, budget), clock))
    await _second_wait(budget, ledger)
    ledger.check_seconds = 0.0  # the next check is quick: its token is still good after it
    budget.grants.put_nowait(clock.now + 0.06)
    assert await asyncio.wait_for(delivering, 5) == Ack()
    assert ledger.calls == [
        "undo_check",
        "budget_wait",
        "last_check",
        "undo_check",
        "budget_wait",
        "last_check",
        "request",
        "complete:delivered",
    ]


async def test_a_send_that_waits_for_nothing_goes_on_its_claims_check_with_a_token_at_hand() -> (
    None
):
    """The claim read every fact and stamped the row; nothing waited since, so no other
    statement runs before the request (the hot path), and the token is taken last."""
    clock = Clock()
    ledger = Ledger(clock)
    budget = Budget(ledger.calls)
    budget.tokens_at_hand, budget.hand_deadline = 1, clock.now + 0.2
    disposition = await _deliver(_deliverer(clock, ledger, budget), clock)
    assert ledger.calls == ["budget_take", "request", "complete:delivered"]
    assert disposition == Ack()


async def test_a_provider_without_a_rate_budget_waits_for_no_token_and_runs_no_statement() -> None:
    """Its token would only carry a throttle pause, which its claim read: the hot path of a
    drain is the claim, the request and the outcome."""
    clock = Clock()
    ledger = Ledger(clock)
    budget = Budget(ledger.calls)
    budget.limited = False
    disposition = await _deliver(_deliverer(clock, ledger, budget), clock)
    assert ledger.calls == ["request", "complete:delivered"]
    assert disposition == Ack()


async def test_a_provider_without_a_rate_budget_paused_by_this_process_is_deferred() -> None:
    clock = Clock()
    ledger = Ledger(clock)
    budget = Budget(ledger.calls)
    budget.limited, budget.paused = False, 2.5
    disposition = await _deliver(_deliverer(clock, ledger, budget), clock)
    assert ledger.calls == ["release"] and isinstance(disposition, Redelay)
    assert disposition.seconds == 2.5


async def test_a_token_outlived_by_both_checks_is_waited_for_with_the_stamp_kept() -> None:
    """The database answers slower than the budget's tokens live: after the second check the
    send waits for its token still stamped (an operator would count it on the wire), and
    goes without a third check instead of looping."""
    clock = Clock()
    ledger = Ledger(clock)
    budget = Budget(ledger.calls)
    ledger.check_seconds = 0.1  # every check outlives its token
    budget.grants = _Fresh(clock)  # type: ignore[assignment]
    disposition = await asyncio.wait_for(_deliver(_deliverer(clock, ledger, budget), clock), 5)
    assert ledger.calls == [
        "undo_check",
        "budget_wait",
        "last_check",
        "undo_check",
        "budget_wait",
        "last_check",
        "budget_wait",
        "request",
        "complete:delivered",
    ]
    assert disposition == Ack()


class _Fresh:
    """Grants a token valid for 60 ms from the moment it is handed out."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    async def get(self) -> float:
        return self.clock.now + 0.06


async def _second_wait(budget: Budget, ledger: Ledger) -> None:
    """Until the delivery waits for its second token."""
    for _ in range(1000):
        if ledger.calls.count("budget_wait") == 2:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"no second budget wait: {ledger.calls}")
