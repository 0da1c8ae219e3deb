"""OpenTelemetry metrics (and the instruments every process records into).

Each process builds one ``Telemetry`` in its composition root and passes ``metrics``
down; nothing here is global except what the OpenTelemetry API itself keeps. Names and
units follow OpenTelemetry conventions (``docs/metrics.md`` lists them).
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import metrics as otel_metrics
from opentelemetry.metrics import Counter, Histogram, Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource


@dataclass(frozen=True)
class Metrics:
    """The instruments. Attributes are low-cardinality: channel, provider, outcome, reason."""

    attempts: Counter
    send_duration: Histogram
    budget_wait: Histogram
    duplicates: Counter
    dead_letters: Counter
    retries_scheduled: Counter
    skipped: Counter
    redelays: Counter
    replays: Counter
    rescues: Counter
    scheduler_lag: Histogram
    run_due: Counter
    run_created: Counter
    run_published: Counter
    poison: Counter
    throttles: Counter
    deferrals: Counter

    @classmethod
    def create(cls, meter: Meter) -> Metrics:
        return cls(
            attempts=meter.create_counter(
                "relay.delivery.attempts", "{attempt}", "Delivery attempts by outcome"
            ),
            send_duration=meter.create_histogram(
                "relay.delivery.send.duration", "s", "Time of one provider request"
            ),
            budget_wait=meter.create_histogram(
                "relay.budget.wait.duration", "s", "Time spent waiting for rate budget"
            ),
            duplicates=meter.create_counter(
                "relay.delivery.duplicates",
                "{message}",
                "Messages for rows already final: acked without sending",
            ),
            dead_letters=meter.create_counter(
                "relay.delivery.dead_letters",
                "{message}",
                "Messages sent to the dead-letter exchange",
            ),
            retries_scheduled=meter.create_counter(
                "relay.delivery.retries", "{delivery}", "Retries scheduled through the delay tiers"
            ),
            skipped=meter.create_counter(
                "relay.delivery.skipped", "{delivery}", "Deliveries skipped on purpose, by reason"
            ),
            redelays=meter.create_counter(
                "relay.delivery.redelays",
                "{message}",
                "Messages parked again because their row was not due yet",
            ),
            replays=meter.create_counter(
                "relay.replay.deliveries", "{delivery}", "Deliveries replayed by an operator"
            ),
            rescues=meter.create_counter(
                "relay.rescue.deliveries", "{delivery}", "Deliveries republished by rescue"
            ),
            scheduler_lag=meter.create_histogram(
                "relay.scheduler.lag", "s", "Intended fire time to publish run start"
            ),
            run_due=meter.create_counter(
                "relay.publish.due", "{occurrence}", "Occurrences found owed by publish runs"
            ),
            run_created=meter.create_counter(
                "relay.publish.created", "{delivery}", "Ledger rows created by publish runs"
            ),
            run_published=meter.create_counter(
                "relay.publish.published", "{message}", "Messages confirmed by the broker"
            ),
            throttles=meter.create_counter(
                "relay.budget.throttles",
                "{response}",
                "Throttle answers that paused a provider's budget",
            ),
            deferrals=meter.create_counter(
                "relay.delivery.deferrals",
                "{delivery}",
                "Sends deferred without an attempt (budget, circuit open, share full)",
            ),
            poison=meter.create_counter(
                "relay.delivery.poison", "{message}", "Malformed or unknown messages dead-lettered"
            ),
        )


@dataclass
class Telemetry:
    """A process's providers and its instruments."""

    meter_provider: MeterProvider
    metrics: Metrics

    def shutdown(self) -> None:
        self.meter_provider.shutdown()


def setup(service_name: str, readers: list[MetricReader] | None = None) -> Telemetry:
    """Build the meter provider for one process (readers: Prometheus, OTLP, in-memory)."""
    provider = MeterProvider(
        metric_readers=readers or [],
        resource=Resource.create({"service.name": service_name}),
    )
    meter = provider.get_meter("reminder-relay")
    return Telemetry(meter_provider=provider, metrics=Metrics.create(meter))


def noop() -> Metrics:
    """Instruments that record nowhere (tools and tests that do not export)."""
    return Metrics.create(otel_metrics.NoOpMeterProvider().get_meter("reminder-relay"))
