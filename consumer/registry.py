"""What one delivery's outcome tells the destinations registry (``service.destinations``).

A 410 Gone disables the destination at once; a failed attempt extends its failure streak,
which may disable it; an accepted one ends the streak. ``lesson`` decides which (pure,
unit-tested); ``Feedback`` writes it, once per attempt, after the outcome is known and
before it is written (``Deliverer._conclude``). ``DestinationPolicy`` says how (and holds
the vault that opens a destination's own secrets).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from consumer import decisions
from consumer.channels.base import Outcome, OutcomeKind
from consumer.store import Store
from service import destinations, logs
from service.ledger import Claimed
from service.telemetry import Metrics

log = logs.get("consumer")


@dataclass(frozen=True)
class DestinationPolicy:
    """What the consumer does with the destinations registry (``service.destinations``)."""

    vault: destinations.Vault | None = field(default=None, repr=False)  # opens own secrets
    failure_streak: int = 0  # failed attempts in a row that disable a destination (0: never)
    failure_span_seconds: float = 0.0  # ... once the streak spans at least this long
    hold_seconds: float = decisions.DISABLED_HOLD_SECONDS  # a held delivery looks again


class Lesson(enum.Enum):
    """What one attempt's outcome tells the registry about its destination."""

    NOTHING = "nothing"
    GONE = "gone"  # a 410: disable the destination now
    FAILED = "failed"  # extend its failure streak (which may disable it)
    SUCCEEDED = "succeeded"  # end its failure streak


def lesson(row: Claimed, outcome: Outcome, *, seen_failing: bool) -> Lesson:
    """The registry's part of ``outcome``. Only webhook destinations are in the registry.
    A failure is a retryable one (timeout, connection error, 5xx, 429) or a refusal the
    receiver answered (a 4xx); a refusal made before any request (no status) is not the
    destination's doing. A success ends a streak only where there is one to end: the
    row's destination had failures, or this process saw it fail lately (``seen_failing``);
    otherwise the registry is not written on the hot path."""
    if row.channel != "webhook" or row.destination is None:
        return Lesson.NOTHING
    if outcome.disable_destination:
        return Lesson.GONE
    if outcome.kind is OutcomeKind.RETRY or (
        outcome.kind is OutcomeKind.REJECTED and outcome.http_status is not None
    ):
        return Lesson.FAILED
    if outcome.kind is OutcomeKind.ACCEPTED and (row.target.failure_streak > 0 or seen_failing):
        return Lesson.SUCCEEDED
    return Lesson.NOTHING


class Feedback:
    """One per consumer process: tells the registry what each attempt's outcome says."""

    def __init__(self, store: Store, metrics: Metrics, policy: DestinationPolicy) -> None:
        self._store = store
        self._metrics = metrics
        self._policy = policy
        self._failing: set[str] = set()  # destinations this process saw fail lately

    async def outcome(self, row: Claimed, outcome: Outcome) -> None:
        """Tell the registry (``lesson``): a 410 disables at once; a failed attempt extends
        the destination's streak (which may disable it); an accepted one ends the streak."""
        url = row.destination
        if url is None:
            return
        taught = lesson(row, outcome, seen_failing=url in self._failing)
        if taught is Lesson.GONE:
            self._disabled(await self._store.disable_gone(url), "gone", None)
        elif taught is Lesson.FAILED:
            if len(self._failing) >= 10_000:
                self._failing.clear()
            self._failing.add(url)
            policy = self._policy
            streak = await self._store.destination_failed(
                url, policy.failure_streak, policy.failure_span_seconds
            )
            if streak is not None and streak.disabled_now:
                self._disabled(streak.destination_id, "failure_streak", streak.failures)
        elif taught is Lesson.SUCCEEDED:
            self._failing.discard(url)
            await self._store.destination_succeeded(url)

    def _disabled(self, destination_id: int | None, reason: str, failures: int | None) -> None:
        if destination_id is None:
            return  # already disabled (another replica, an operator)
        self._metrics.destinations_disabled.add(1, {"reason": reason})
        log.warning(
            "destination disabled; its deliveries are held until `relay destinations enable`",
            extra={
                "event": "destination_disabled",
                "destination_id": destination_id,
                "reason": reason,
                "failures": failures,
            },
        )
