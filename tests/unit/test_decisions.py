"""The pure send decision and the completions built from it: every branch of ``verdict``,
``after_attempt`` and ``skipped`` (no I/O, no clock)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from consumer import decisions
from consumer.channels.base import Outcome, OutcomeKind
from consumer.retry import Action, Decision
from service.ledger import Attempt, Claimed, Completion, SendFacts, State

NOW = datetime(2026, 3, 1, 6, 0, tzinfo=UTC)
FRESH = SendFacts(
    active=True,
    age_seconds=10.0,
    stale_after_seconds=3600.0,
    send_stale=False,
    destination_disabled=False,
    provider_paused_seconds=0.0,
)


def _row(**changes: object) -> Claimed:
    row = Claimed(
        id=7,
        idempotency_key="reminder:r1:2026-03-01T06:00:00Z:webhook",
        reminder_id="r1",
        channel="webhook",
        provider="acme",
        occurrence_at=NOW,
        urgent=False,
        attempts=3,
        round_start=1,
        run_id=11,
        prior_state="queued",
        destination="https://partner.example/hook",
        payload={"text": "hi"},
        payload_version=2,
        facts=FRESH,
    )
    return replace(row, **changes)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- verdict


def test_an_active_fresh_row_with_a_destination_is_sent_not_stale() -> None:
    assert decisions.verdict(FRESH, has_destination=True) == decisions.Send(stale=False)


def test_a_cancelled_reminder_is_skipped_as_cancelled() -> None:
    facts = replace(FRESH, active=False)
    assert decisions.verdict(facts, has_destination=True) == decisions.Skip("cancelled")


def test_a_row_without_destination_or_payload_is_skipped_as_cancelled() -> None:
    # A schedule row whose reminder is gone has nothing to send to.
    assert decisions.verdict(FRESH, has_destination=False) == decisions.Skip("cancelled")


def test_cancelled_wins_over_every_other_fact() -> None:
    facts = SendFacts(
        active=False,
        age_seconds=1e6,
        stale_after_seconds=1.0,
        send_stale=False,
        destination_disabled=True,
        provider_paused_seconds=30.0,
    )
    assert decisions.verdict(facts, has_destination=True) == decisions.Skip("cancelled")


def test_a_suppressed_address_is_skipped_before_staleness_pauses_or_a_disabled_destination() -> (
    None
):
    facts = replace(
        FRESH,
        suppressed=True,
        age_seconds=1e6,
        destination_disabled=True,
        provider_paused_seconds=9,
    )
    assert decisions.verdict(facts, has_destination=True) == decisions.Skip("suppressed")
    assert decisions.verdict(replace(facts, active=False), has_destination=True) == (
        decisions.Skip("cancelled")
    )


def test_an_accepted_email_or_sms_waits_for_its_receipt_a_webhook_is_delivered() -> None:
    outcome = Outcome(OutcomeKind.ACCEPTED, http_status=200, receipt="m-1", message_id="m-1")
    decision = Decision(Action.DELIVERED)
    for channel, state in (
        ("webhook", State.DELIVERED),
        ("email", State.ACCEPTED),
        ("sms", State.ACCEPTED),
    ):
        record = decisions.attempt_record(
            _row(channel=channel), outcome, started_at=NOW, latency_seconds=0.1, stale=False
        )
        assert record.provider_message_id == "m-1"
        done = decisions.after_attempt(_row(channel=channel), outcome, decision, record, now=NOW)
        assert (done.state, done.receipt) == (state, "m-1")


def test_a_row_of_a_held_run_is_parked_before_any_other_fact_is_read() -> None:
    facts = replace(FRESH, run_held=True, active=False, destination_disabled=True)
    verdict = decisions.verdict(facts, has_destination=True, held_recheck_seconds=12.5)
    assert verdict == decisions.Hold(decisions.RUN_HELD, 12.5)


def test_a_cancel_of_the_run_asked_while_on_the_wire_skips_it_before_any_other_fact() -> None:
    facts = replace(FRESH, stop_action="cancel", stop_reason="sent by hand", run_held=True)
    assert decisions.verdict(facts, has_destination=True) == decisions.Skip("cancelled")


def test_a_dead_letter_of_the_run_asked_while_on_the_wire_kills_it_with_the_reason() -> None:
    facts = replace(FRESH, stop_action="dead-letter", stop_reason="bad template", run_held=True)
    assert decisions.verdict(facts, has_destination=True) == decisions.Kill(
        "dead-lettered by an operator: bad template"
    )


def test_a_dead_letter_without_a_reason_says_so() -> None:
    facts = replace(FRESH, stop_action="dead-letter")
    assert decisions.verdict(facts, has_destination=True) == decisions.Kill(
        "dead-lettered by an operator: no reason"
    )


def test_killed_ends_the_claimed_attempt_dead_without_a_request() -> None:
    error = "dead-lettered by an operator: bad template"
    assert decisions.killed(_row(), error) == Completion(
        id=7,
        attempt=3,
        state=State.DEAD,
        error=error,
        record=Attempt(outcome="skipped", error=error, possibly_delivered=False),
    )


def test_older_than_stale_after_is_skipped_as_stale() -> None:
    facts = replace(FRESH, age_seconds=3600.5)
    assert decisions.verdict(facts, has_destination=True) == decisions.Skip("stale")


def test_exactly_at_stale_after_is_not_stale_yet() -> None:
    facts = replace(FRESH, age_seconds=3600.0)
    assert decisions.verdict(facts, has_destination=True) == decisions.Send(stale=False)


def test_older_than_stale_after_with_send_stale_is_sent_marked_stale() -> None:
    facts = replace(FRESH, age_seconds=7200.0, send_stale=True)
    assert decisions.verdict(facts, has_destination=True) == decisions.Send(stale=True)


def test_without_stale_after_a_row_is_never_stale() -> None:
    facts = replace(FRESH, age_seconds=1e9, stale_after_seconds=None)
    assert decisions.verdict(facts, has_destination=True) == decisions.Send(stale=False)


def test_send_stale_on_a_fresh_row_sends_it_unmarked() -> None:
    facts = replace(FRESH, send_stale=True)
    assert decisions.verdict(facts, has_destination=True) == decisions.Send(stale=False)


def test_stale_is_decided_before_a_disabled_destination() -> None:
    facts = replace(FRESH, age_seconds=1e6, destination_disabled=True)
    assert decisions.verdict(facts, has_destination=True) == decisions.Skip("stale")


def test_a_disabled_destination_is_held_not_refused() -> None:
    facts = replace(FRESH, destination_disabled=True)
    assert decisions.verdict(facts, has_destination=True, hold_seconds=7.0) == decisions.Hold(
        decisions.DISABLED_DESTINATION, 7.0
    )


def test_a_stale_row_sent_stale_to_a_disabled_destination_is_held() -> None:
    facts = replace(FRESH, age_seconds=1e6, send_stale=True, destination_disabled=True)
    assert decisions.verdict(facts, has_destination=True) == decisions.Hold(
        decisions.DISABLED_DESTINATION, decisions.DISABLED_HOLD_SECONDS
    )


def test_a_disabled_destination_is_held_even_while_its_provider_is_paused() -> None:
    facts = replace(FRESH, destination_disabled=True, provider_paused_seconds=5.0)
    verdict = decisions.verdict(facts, has_destination=True, hold_seconds=60.0)
    assert verdict == decisions.Hold(decisions.DISABLED_DESTINATION, 60.0)


def test_a_paused_provider_holds_the_send_for_the_pause() -> None:
    facts = replace(FRESH, provider_paused_seconds=2.5)
    assert decisions.verdict(facts, has_destination=True) == decisions.Hold("provider paused", 2.5)


def test_a_pause_its_rate_budget_waits_out_is_not_parked_for_at_the_claim() -> None:
    facts = replace(FRESH, provider_paused_seconds=2.5)
    verdict = decisions.verdict(facts, has_destination=True, budget_obeys_pause=True)
    assert verdict == decisions.Send(stale=False)


def test_a_stale_row_with_send_stale_still_waits_out_a_pause() -> None:
    facts = replace(FRESH, age_seconds=1e6, send_stale=True, provider_paused_seconds=1.0)
    assert decisions.verdict(facts, has_destination=True) == decisions.Hold("provider paused", 1.0)


# ------------------------------------------------------------------------- skipped


@pytest.mark.parametrize("reason", ["cancelled", "stale"])
def test_skipped_ends_the_claimed_attempt_skipped_with_its_reason(reason: str) -> None:
    row = _row()
    assert decisions.skipped(row, reason) == Completion(
        id=7,
        attempt=3,
        state=State.SKIPPED,
        skip_reason=reason,
        record=Attempt(outcome="skipped", error=reason),
    )


# ------------------------------------------------------------------------- refused


def test_refused_is_a_rejected_outcome_with_the_error_and_nothing_sent() -> None:
    assert decisions.refused("no") == Outcome(
        OutcomeKind.REJECTED, error="no", possibly_delivered=False
    )


# ------------------------------------------------------------------------- attempt_record


def test_attempt_record_carries_the_outcome_timing_version_and_stale_mark() -> None:
    outcome = Outcome(OutcomeKind.RETRY, http_status=503, error="http 503", response_excerpt="busy")
    record = decisions.attempt_record(
        _row(), outcome, started_at=NOW, latency_seconds=0.25, stale=True
    )
    assert record == Attempt(
        outcome="retry",
        http_status=503,
        latency_ms=250.0,
        error="http 503",
        response_excerpt="busy",
        payload_version=2,
        started_at=NOW,
        stale=True,
        possibly_delivered=True,
    )


# ------------------------------------------------------------------------- after_attempt


def _record(kind: str) -> Attempt:
    return Attempt(outcome=kind)


def test_delivered_writes_delivered_with_status_and_receipt_and_nothing_else() -> None:
    outcome = Outcome(OutcomeKind.ACCEPTED, http_status=200, receipt="msg-1", error="ignored")
    completion = decisions.after_attempt(
        _row(), outcome, Decision(Action.DELIVERED), _record("accepted"), now=NOW
    )
    assert completion == Completion(
        7, 3, State.DELIVERED, status=200, receipt="msg-1", record=_record("accepted")
    )


def test_retry_writes_retrying_at_now_plus_the_delay() -> None:
    outcome = Outcome(OutcomeKind.RETRY, http_status=503, error="http 503")
    completion = decisions.after_attempt(
        _row(), outcome, Decision(Action.RETRY, delay_seconds=12.5), _record("retry"), now=NOW
    )
    assert completion == Completion(
        7,
        3,
        State.RETRYING,
        next_attempt_at=NOW + timedelta(seconds=12.5),
        status=503,
        error="http 503",
        record=_record("retry"),
    )


def test_retry_without_a_delay_is_a_bug_caught_at_once() -> None:
    outcome = Outcome(OutcomeKind.RETRY, http_status=503)
    with pytest.raises(AssertionError):
        decisions.after_attempt(_row(), outcome, Decision(Action.RETRY), _record("retry"), now=NOW)


def test_dead_with_reason_and_error_joins_them() -> None:
    outcome = Outcome(OutcomeKind.REJECTED, http_status=422, error="http 422")
    completion = decisions.after_attempt(
        _row(), outcome, Decision(Action.DEAD, reason="rejected"), _record("rejected"), now=NOW
    )
    assert completion == Completion(
        7, 3, State.DEAD, status=422, error="rejected: http 422", record=_record("rejected")
    )


def test_dead_without_an_error_is_the_reason_alone() -> None:
    outcome = Outcome(OutcomeKind.RETRY, http_status=503)
    decision = Decision(Action.DEAD, reason="attempts exhausted")
    completion = decisions.after_attempt(_row(), outcome, decision, _record("retry"), now=NOW)
    assert (completion.state, completion.error) == (State.DEAD, "attempts exhausted")


def test_dead_without_a_reason_or_an_error_says_dead() -> None:
    outcome = Outcome(OutcomeKind.REJECTED)
    completion = decisions.after_attempt(
        _row(), outcome, Decision(Action.DEAD), _record("rejected"), now=NOW
    )
    assert (completion.state, completion.error, completion.status) == (State.DEAD, "dead", None)


def test_dead_without_a_reason_but_with_an_error_says_dead_and_the_error() -> None:
    outcome = Outcome(OutcomeKind.REJECTED, error="ssrf: loopback address")
    completion = decisions.after_attempt(
        _row(), outcome, Decision(Action.DEAD), _record("rejected"), now=NOW
    )
    assert completion.error == "dead: ssrf: loopback address"


@pytest.mark.parametrize("action", [Action.DELIVERED, Action.RETRY, Action.DEAD])
def test_every_completion_is_fenced_by_the_claimed_id_and_attempt(action: Action) -> None:
    row = _row(id=99, attempts=5)
    decision = Decision(action, delay_seconds=1.0 if action is Action.RETRY else None)
    completion = decisions.after_attempt(
        row, Outcome(OutcomeKind.ACCEPTED), decision, _record("accepted"), now=NOW
    )
    assert (completion.id, completion.attempt) == (99, 5)
