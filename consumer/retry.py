"""The retry policy: a pure function from an attempt's outcome to what happens next.

Classification is the channel adapter's job (accepted / retry / throttled / rejected);
timing is this module's: capped exponential backoff with jitter, ``Retry-After``
honoured up to a maximum, and a finite attempt budget per channel. No I/O, no clock:
the random source is passed in, so every branch is unit-tested exactly.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from consumer.channels.base import OutcomeKind


class Action(enum.StrEnum):
    DELIVERED = "delivered"
    RETRY = "retry"
    DEAD = "dead"


@dataclass(frozen=True)
class Decision:
    action: Action
    delay_seconds: float | None = None  # RETRY: time until the next attempt
    reason: str | None = None  # DEAD: why, for the dead-letter header and the ledger


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff ``base * multiplier**(n-1)`` capped at ``max_seconds``, with equal jitter.

    Equal jitter (half fixed, half random) spreads a thundering herd of retries while
    keeping each delay at least half the nominal one.
    """

    base_seconds: float = 30.0
    multiplier: float = 4.0
    max_seconds: float = 6 * 3600.0
    retry_after_max_seconds: float = 3600.0
    max_attempts: int = 8
    max_attempts_by_channel: Mapping[str, int] = field(default_factory=dict)

    def attempts_for(self, channel: str) -> int:
        return self.max_attempts_by_channel.get(channel, self.max_attempts)

    def backoff_seconds(self, attempt: int, random: Callable[[], float]) -> float:
        """Delay after failed attempt number ``attempt`` (1-based) of this round."""
        nominal = min(self.max_seconds, self.base_seconds * self.multiplier ** (attempt - 1))
        return nominal / 2 + random() * nominal / 2

    def decide(
        self,
        kind: OutcomeKind,
        *,
        channel: str,
        attempt: int,
        retry_after_seconds: float | None,
        random: Callable[[], float],
    ) -> Decision:
        """What follows attempt number ``attempt`` (1-based, within the current round)."""
        if kind is OutcomeKind.ACCEPTED:
            return Decision(Action.DELIVERED)
        if kind is OutcomeKind.REJECTED:
            return Decision(Action.DEAD, reason="rejected")
        if attempt >= self.attempts_for(channel):
            return Decision(Action.DEAD, reason="attempts exhausted")
        if retry_after_seconds is not None and retry_after_seconds > 0:
            # The provider said when: never earlier; a longer wait is capped, not obeyed.
            delay = min(retry_after_seconds, self.retry_after_max_seconds)
            return Decision(Action.RETRY, delay_seconds=max(delay, 0.0))
        return Decision(Action.RETRY, delay_seconds=self.backoff_seconds(attempt, random))


def parse_attempts_by_channel(text: str) -> dict[str, int]:
    """``"sms=4,email=10"`` -> {"sms": 4, "email": 10}; ValueError names the bad part."""
    result: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"expected channel=attempts, got {part!r}")
        result[name.strip()] = int(value)
    return result
