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
    # Retention (service.retention.facts): when the newest purge finished whole (Unix time;
    # before the first, when retention was installed), how often one is scheduled (the
    # setting), the age of the oldest final delivery kept and of the oldest still holding its
    # content (channel -> s), and what every purge removed ("table/kind" -> rows).
    purge_last_finished: float | None = None
    purge_period_seconds: float | None = None
    oldest_final_seconds: dict[str, float] = field(default_factory=dict)
    oldest_content_seconds: dict[str, float] = field(default_factory=dict)
    purged_totals: dict[str, int] = field(default_factory=dict)


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
    _retention_gauges(gauge, snapshot)
    meter.create_observable_counter(
        "relay.purge.rows",
        [lambda _: _purged(snapshot)],
        "{row}",
        "Rows relay purge deleted (kind rows) or emptied of their content (kind content), by "
        "table, ever: read from the ledger, so every consumer reports the same total",
    )


# Counters among the instruments above (read from the ledger, not counted in the process).
SNAPSHOT_COUNTERS = ("relay.purge.rows",)


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


def _retention_gauges(gauge: _Gauge, snapshot: Snapshot) -> None:
    gauge(
        "relay.purge.last_run.timestamp",
        "s",
        "When the newest relay purge finished whole (Unix time); before the first, when "
        "retention was installed",
        lambda: _optional(snapshot.purge_last_finished),
    )
    gauge(
        "relay.purge.period",
        "s",
        "How often relay purge is scheduled (RELAY_RETENTION_PURGE_PERIOD_HOURS)",
        lambda: _optional(snapshot.purge_period_seconds),
    )
    gauge(
        "relay.retention.oldest_final.age",
        "s",
        "Since the oldest final delivery still kept ended, by channel",
        lambda: [Observation(v, {"channel": c}) for c, v in snapshot.oldest_final_seconds.items()],
    )
    gauge(
        "relay.retention.oldest_content.age",
        "s",
        "Since the oldest final delivery still holding its content ended, by channel",
        lambda: [
            Observation(v, {"channel": c}) for c, v in snapshot.oldest_content_seconds.items()
        ],
    )


def _purged(snapshot: Snapshot) -> list[Observation]:
    found = []
    for key, n in list(snapshot.purged_totals.items()):
        table, _, kind = key.partition("/")
        found.append(Observation(n, {"table": table, "kind": kind}))
    return found


def _optional(value: float | None) -> list[Observation]:
    return [] if value is None else [Observation(value)]
