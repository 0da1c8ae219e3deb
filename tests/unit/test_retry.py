"""The retry policy, every branch (pure: no I/O, the random source is passed in)."""

from __future__ import annotations

import pytest

from consumer.channels.base import OutcomeKind
from consumer.retry import Action, Decision, RetryPolicy, parse_attempts_by_channel

POLICY = RetryPolicy(
    base_seconds=30,
    multiplier=4,
    max_seconds=6 * 3600,
    retry_after_max_seconds=3600,
    max_attempts=8,
    max_attempts_by_channel={"sms": 3},
)


def decide(
    kind: OutcomeKind,
    attempt: int,
    retry_after: float | None = None,
    channel: str = "webhook",
    rnd: float = 0.5,
) -> Decision:
    return POLICY.decide(
        kind, channel=channel, attempt=attempt, retry_after_seconds=retry_after, random=lambda: rnd
    )


@pytest.mark.parametrize("attempt", [1, 7, 8, 50])
def test_accepted_is_delivered_at_any_attempt(attempt: int) -> None:
    assert decide(OutcomeKind.ACCEPTED, attempt) == Decision(Action.DELIVERED)


@pytest.mark.parametrize("attempt", [1, 3, 8])
def test_rejected_is_dead_at_once(attempt: int) -> None:
    assert decide(OutcomeKind.REJECTED, attempt) == Decision(Action.DEAD, reason="rejected")


@pytest.mark.parametrize("kind", [OutcomeKind.RETRY, OutcomeKind.THROTTLED])
def test_retryable_outcomes_retry_until_the_budget_then_die(kind: OutcomeKind) -> None:
    for attempt in range(1, 8):
        assert decide(kind, attempt).action is Action.RETRY
    assert decide(kind, 8) == Decision(Action.DEAD, reason="attempts exhausted")
    assert decide(kind, 9).action is Action.DEAD


def test_per_channel_budget_overrides_the_default() -> None:
    assert decide(OutcomeKind.RETRY, 2, channel="sms").action is Action.RETRY
    assert decide(OutcomeKind.RETRY, 3, channel="sms").action is Action.DEAD
    assert decide(OutcomeKind.RETRY, 3, channel="email").action is Action.RETRY


@pytest.mark.parametrize(
    ("attempt", "nominal"),
    [(1, 30), (2, 120), (3, 480), (4, 1920), (5, 7680), (6, 21600), (7, 21600)],
)
def test_backoff_is_capped_exponential_with_equal_jitter(attempt: int, nominal: float) -> None:
    low = decide(OutcomeKind.RETRY, attempt, rnd=0.0).delay_seconds
    high = decide(OutcomeKind.RETRY, attempt, rnd=1.0).delay_seconds
    assert (low, high) == (nominal / 2, nominal)


def test_schedule_with_defaults_spans_about_a_day() -> None:
    total = sum(POLICY.backoff_seconds(n, lambda: 1.0) for n in range(1, 8))
    assert 12 * 3600 < total < 30 * 3600


def test_retry_after_is_honoured_exactly_and_capped() -> None:
    assert decide(OutcomeKind.THROTTLED, 1, retry_after=7).delay_seconds == 7
    assert decide(OutcomeKind.RETRY, 1, retry_after=7, rnd=0.0).delay_seconds == 7
    assert decide(OutcomeKind.THROTTLED, 1, retry_after=99999).delay_seconds == 3600


@pytest.mark.parametrize("retry_after", [None, 0, -5])
def test_missing_or_nonpositive_retry_after_falls_back_to_backoff(
    retry_after: float | None,
) -> None:
    assert decide(OutcomeKind.THROTTLED, 1, retry_after=retry_after, rnd=0.0).delay_seconds == 15


def test_retry_after_does_not_extend_the_attempt_budget() -> None:
    assert decide(OutcomeKind.THROTTLED, 8, retry_after=5).action is Action.DEAD


def test_parse_attempts_by_channel() -> None:
    assert parse_attempts_by_channel("") == {}
    assert parse_attempts_by_channel("sms=4, email=10") == {"sms": 4, "email": 10}
    for bad in ("sms", "sms=0", "sms=x", "=3"):
        with pytest.raises(ValueError):
            parse_attempts_by_channel(bad)
