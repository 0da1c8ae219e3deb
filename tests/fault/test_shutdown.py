"""SIGTERM gives work back (issue 12): a consumer stopped while its sends wait for a
rate budget releases its claims without counting an attempt.

50 webhook deliveries, one consumer with ``RELAY_BUDGETS=webhook=1/1`` (the prefetch of
200 takes all 50; one is sent per second), ``RELAY_BUDGET_MAX_WAIT_SECONDS`` at its 30 s
default, longer than ``RELAY_SHUTDOWN_GRACE_SECONDS`` (5 s). A few seconds in, SIGTERM:

- exit 0 within the grace + 10 s;
- right after: no row ``sending``, no ``lost`` attempt, and every row's ``attempts``
  equals the requests the partner really received with its key;
- a new consumer (its budget raised to 50/s, so the test does not wait 45 s) delivers
  every row, still with ``attempts`` equal to the partner's requests per key, no ``lost``
  attempt, one logical event per key, no dead letter.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.settings import Settings
from tests.support.fleet import Facts, Fleet, eventually
from tests.support.relay import RunningPartner

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]

ROWS = 50


async def _attempts_match_requests(fleet: Fleet, facts: Facts, when: str) -> None:
    """Each row's attempts = requests the partner received with its key."""
    seen = fleet.partner.state.events
    wrong = [
        (r["id"], r["state"], r["attempts"], seen.get(r["idempotency_key"], 0))
        for r in await fleet.ledger.rows()
        if r["attempts"] != seen.get(r["idempotency_key"], 0)
    ]
    facts.check(
        not wrong,
        f"{when}: {len(wrong)} rows whose attempts differ from the requests the partner "
        f"received (id, state, attempts, requests): {wrong[:10]}",
    )


async def test_sigterm_while_sends_wait_for_budget_releases_claims_without_attempts(
    settings: Settings, partner: RunningPartner, tmp_path: Path
) -> None:
    settings = settings.model_copy(
        update={"lease_seconds": 10.0, "http_timeout_seconds": 5.0, "shutdown_grace_seconds": 5.0}
    )
    fleet = Fleet(settings, partner, tmp_path / "logs")
    try:
        await fleet.prepare(ROWS, path=lambda _: "ok")
        (slot,) = await fleet.start_consumers(1, BUDGETS="webhook=1/1")

        async def some_sent() -> bool:
            return sum(partner.state.requests_by_path.values()) >= 3

        assert await fleet.supervisor.wait_ready(slot), "consumer never ready"
        assert await eventually(some_sent, 30), "no sends under the 1/s budget"
        states = await fleet.ledger.states()
        fleet.note(f"at SIGTERM: {states}, partner requests {partner.state.stats()['requests']}")

        facts = Facts(fleet)
        stopped = await fleet.supervisor.sigterm(slot, fleet.sigterm_bound, restart=False)
        facts.check(
            stopped.code == 0 and not stopped.killed,
            f"SIGTERM under budget: {stopped} (bound {fleet.sigterm_bound:.0f} s)",
        )
        after = await fleet.ledger.states()
        fleet.note(f"after SIGTERM: {after}")
        facts.check(after.get("sending", 0) == 0, f"rows left 'sending' after SIGTERM: {after}")
        outcomes = await fleet.ledger.attempt_outcomes()
        facts.check(
            outcomes.get("lost", 0) == 0, f"'lost' attempts right after SIGTERM: {outcomes}"
        )
        await _attempts_match_requests(fleet, facts, "right after SIGTERM")

        await fleet.start_consumers(1, BUDGETS="webhook=50/10")
        restarted = fleet.note("second consumer started")
        await fleet.expect_all_delivered(facts, within=settings.lease_seconds + 30, since=restarted)
        outcomes = await fleet.ledger.attempt_outcomes()
        fleet.note(f"attempt outcomes: {outcomes}")
        facts.check(outcomes.get("lost", 0) == 0, f"'lost' attempts at the end: {outcomes}")
        await _attempts_match_requests(fleet, facts, "at the end")
        await fleet.finish(facts)
        facts.assert_all()
    finally:
        await fleet.stop()
        print(fleet.describe())
