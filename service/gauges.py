"""The observable gauges every consumer exports: what they read (``Snapshot``, refreshed by
the consumer's sampler task, since gauge callbacks are synchronous) and how they are named.
Listed in ``docs/metrics.md`` with the rest of ``service.telemetry``.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from service import conventions


@dataclass
class Snapshot:
    """Values observed by the gauges, refreshed by the consumer's sampler task."""

    queue_depth: dict[str, int] = field(default_factory=dict)  # queue -> ready messages
    states: dict[str, int] = field(default_factory=dict)  # ledger state -> rows
    destinations: dict[str, int] = field(default_factory=dict)  # enabled/disabled -> count
    oldest_claimable_seconds: float = 0.0
    latest_run_completion: float | None = None
    latest_run_age_seconds: float | None = None
    latest_run_lag_seconds: float | None = None
    # Unix time the newest publish run started, empty runs included: a timestamp, not an
    # age, so a sampler that stops refreshing cannot freeze it young.
    last_publish_start: float | None = None
    # That run's scheduler lag: an empty run found nothing overdue, so one on-time run after a
    # late one brings it back to about 0 (RelaySchedulerLagHigh reads it).
    last_publish_lag_seconds: float | None = None
    ready: bool = False


def register_gauges(meter: Meter, snapshot: Snapshot) -> None:
    """The observable gauges; each reads ``snapshot`` when the reader collects."""

    def gauge(
        name: str, unit: str, description: str, read: Callable[[], Iterable[Observation]]
    ) -> None:
        def callback(_: CallbackOptions) -> Iterable[Observation]:
            return list(read())

        meter.create_observable_gauge(name, [callback], unit, description)

    _ledger_gauges(gauge, snapshot)
    _run_gauges(gauge, snapshot)


_Gauge = Callable[[str, str, str, Callable[[], Iterable[Observation]]], None]


def _ledger_gauges(gauge: _Gauge, snapshot: Snapshot) -> None:
    gauge(
        "relay.queue.depth",
        "{message}",
        "Messages ready in each queue",
        lambda: [Observation(n, {"queue": q}) for q, n in snapshot.queue_depth.items()],
    )
    gauge(
        "relay.deliveries",
        "{delivery}",
        "Ledger rows by state",
        lambda: [Observation(n, {"state": s}) for s, n in snapshot.states.items()],
    )
    gauge(
        "relay.destinations",
        "{destination}",
        "Registered webhook destinations by state (enabled, disabled)",
        lambda: [Observation(n, {"state": s}) for s, n in snapshot.destinations.items()],
    )
    gauge(
        "relay.deliveries.oldest_claimable.age",
        "s",
        "Age of the oldest delivery that could be worked now (not waiting for a retry)",
        lambda: [Observation(snapshot.oldest_claimable_seconds)],
    )


def _run_gauges(gauge: _Gauge, snapshot: Snapshot) -> None:
    gauge(
        "relay.run.completion_ratio",
        "1",
        "Delivered over the rows of the latest publish run meant to be sent (not skipped)",
        lambda: _optional(snapshot.latest_run_completion),
    )
    gauge(
        "relay.run.age",
        "s",
        "Time since the latest publish run's intended fire time",
        lambda: _optional(snapshot.latest_run_age_seconds),
    )
    gauge(
        "relay.run.lag",
        "s",
        "Scheduler lag of the latest publish run that admitted work",
        lambda: _optional(snapshot.latest_run_lag_seconds),
    )
    gauge(
        "relay.run.last_start.timestamp",
        "s",
        "When the newest publish run started (Unix time), whether it admitted work or not",
        lambda: _optional(snapshot.last_publish_start),
    )
    gauge(
        "relay.run.last_start.lag",
        "s",
        "Scheduler lag of the newest publish run, whether it admitted work or not",
        lambda: _optional(snapshot.last_publish_lag_seconds),
    )
    build = {"version": conventions.version(), "python": platform.python_version()}
    gauge(
        "relay.build.info",
        "1",
        "Always 1; the relay's version and Python version as labels",
        lambda: [Observation(1, build)],
    )
    gauge(
        "relay.consumer.ready",
        "1",
        "1 while connected to broker and database and consuming",
        lambda: [Observation(1 if snapshot.ready else 0)],
    )


def _optional(value: float | None) -> list[Observation]:
    return [] if value is None else [Observation(value)]
