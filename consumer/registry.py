"""What one delivery's outcome tells the destinations registry (``service.destinations``).

A 410 Gone disables the destination at once; a failed attempt extends its failure streak,
which may disable it; an accepted one ends the streak. ``DestinationPolicy`` says how (and
holds the vault that opens a destination's own secrets).
"""

from __future__ import annotations

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


class Feedback:
    """One per consumer process: tells the registry what each attempt's outcome says."""

    def __init__(self, store: Store, metrics: Metrics, policy: DestinationPolicy) -> None:
        self._store = store
        self._metrics = metrics
        self._policy = policy
        self._failing: set[str] = set()  # destinations this process saw fail lately

    async def outcome(self, row: Claimed, outcome: Outcome) -> None:
        """Tell the registry: a 410 disables at once; a failed attempt extends the
        destination's streak (which may disable it); an accepted one ends the streak."""
        url = row.destination
        if row.channel != "webhook" or url is None:
            return
        if outcome.disable_destination:
            self._disabled(await self._store.disable_gone(url), "gone", None)
            return
        failed = outcome.kind is OutcomeKind.RETRY or (
            outcome.kind is OutcomeKind.REJECTED and outcome.http_status is not None
        )
        if failed:
            if len(self._failing) >= 10_000:
                self._failing.clear()
            self._failing.add(url)
            policy = self._policy
            streak = await self._store.destination_failed(
                url, policy.failure_streak, policy.failure_span_seconds
            )
            if streak is not None and streak.disabled_now:
                self._disabled(streak.destination_id, "failure_streak", streak.failures)
        elif outcome.kind is OutcomeKind.ACCEPTED and (
            row.target.failure_streak > 0 or url in self._failing
        ):
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
