"""OpenTelemetry metrics and traces for every relay process.

Each process builds one ``Telemetry`` in its composition root (``setup``) and passes
``metrics`` and ``tracer`` down; nothing here is global except the W3C trace-context
propagator the OpenTelemetry API keeps. Names and units follow OpenTelemetry
conventions and are listed in ``docs/metrics.md``; attributes are low-cardinality
(channel, provider, outcome, reason, state, queue) and never recipient data.

Export: the consumer and the console serve ``/metrics`` for Prometheus
(``PrometheusMetricReader``);
any process pushes metrics and traces by OTLP/HTTP when ``OTEL_EXPORTER_OTLP_ENDPOINT``
is set (the short-lived publisher flushes before it exits).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from opentelemetry import metrics as otel_metrics
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from service import conventions
from service.gauges import Snapshot, register_gauges

# Seconds: from a fast local receiver (ms) to a provider at its timeout (10 s+).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Seconds from due to accepted: on time is well under a second, a retry takes minutes.
_LATENESS_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_LAG_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 86400)


@dataclass(frozen=True)
class Metrics:
    """The instruments, grouped as in ``docs/metrics.md``."""

    # Sends: recorded by the consumer around each request.
    attempts: LocalCounter
    send_duration: Histogram
    lateness: Histogram
    budget_wait: Histogram
    throttles: Counter
    # Messages: recorded by the consumer when one ends without a request, or not for now.
    deferrals: Counter
    duplicates: Counter
    dead_letters: Counter
    retries_scheduled: Counter
    skipped: Counter
    redelays: Counter
    poison: Counter
    # Repairs: what the consumer changed beyond one delivery.
    destinations_disabled: Counter
    overdue_republished: Counter
    overdue_duplicates: Counter
    # Publish runs, rescue and replay: recorded by the publisher's commands.
    replays: Counter
    rescues: Counter
    scheduler_lag: Histogram
    run_due: Counter
    run_created: Counter
    run_published: Counter
    # The operator console: recorded by `relay console`.
    console_login_failures: Counter
    # What the gauges report, refreshed by the consumer's sampler.
    snapshot: Snapshot

    @classmethod
    def create(cls, meter: Meter) -> Metrics:
        """Register every instrument on ``meter``; the gauges read the new ``snapshot``."""
        snapshot = Snapshot()
        register_gauges(meter, snapshot)
        return cls(
            **_send_instruments(meter),
            **_message_instruments(meter),
            **_repair_instruments(meter),
            **_run_instruments(meter),
            console_login_failures=meter.create_counter(
                "relay.console.login.failures",
                "{attempt}",
                "Console logins refused: a wrong name or token, or a blocked address",
            ),
            snapshot=snapshot,
        )


class LocalCounter:
    """A monotonic counter summed in this process and read by the SDK when it collects.

    For a count made once per delivery: the SDK's ``Counter.add`` builds a measurement,
    checks and hashes its attributes and takes a lock (~7 us), a few percent of the
    consumer's CPU; a dict update is a fraction of that. Exported exactly as a counter
    (an observable one): same name, unit and attributes.
    """

    def __init__(self, meter: Meter, name: str, unit: str, description: str) -> None:
        self._totals: dict[tuple[tuple[str, str], ...], int] = {}
        meter.create_observable_counter(name, [self._observe], unit, description)

    def add(self, amount: int, attributes: Mapping[str, str]) -> None:
        key = tuple(attributes.items())
        self._totals[key] = self._totals.get(key, 0) + amount

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(total, dict(key)) for key, total in list(self._totals.items())]


# The groups of counters and histograms as typed keyword arguments of ``Metrics``, so
# mypy checks each name and type against the fields above.
class _SendInstruments(TypedDict):
    attempts: LocalCounter
    send_duration: Histogram
    lateness: Histogram
    budget_wait: Histogram
    throttles: Counter


class _MessageInstruments(TypedDict):
    deferrals: Counter
    duplicates: Counter
    dead_letters: Counter
    retries_scheduled: Counter
    skipped: Counter
    redelays: Counter
    poison: Counter


class _RepairInstruments(TypedDict):
    destinations_disabled: Counter
    overdue_republished: Counter
    overdue_duplicates: Counter


class _RunInstruments(TypedDict):
    replays: Counter
    rescues: Counter
    scheduler_lag: Histogram
    run_due: Counter
    run_created: Counter
    run_published: Counter


def _send_instruments(meter: Meter) -> _SendInstruments:
    """The consumer's instruments of one request: its outcome, its time, its lateness and
    the budget it waited for."""
    return _SendInstruments(
        attempts=LocalCounter(
            meter, "relay.delivery.attempts", "{attempt}", "Delivery attempts by outcome"
        ),
        send_duration=_seconds_histogram(
            meter, "relay.delivery.send.duration", "Time of one provider request", _LATENCY_BUCKETS
        ),
        lateness=_seconds_histogram(
            meter,
            "relay.delivery.lateness",
            "From an occurrence's due time to the receiver accepting it, by channel and lane",
            _LATENESS_BUCKETS,
        ),
        budget_wait=_seconds_histogram(
            meter,
            "relay.budget.wait.duration",
            "Time spent waiting for rate budget",
            _WAIT_BUCKETS,
        ),
        throttles=meter.create_counter(
            "relay.budget.throttles",
            "{response}",
            "Throttle answers that paused a provider's budget",
        ),
    )


def _message_instruments(meter: Meter) -> _MessageInstruments:
    """The consumer's counters of what became of a message other than one request."""
    return _MessageInstruments(
        deferrals=meter.create_counter(
            "relay.delivery.deferrals",
            "{delivery}",
            "Sends deferred without an attempt (budget, circuit, share)",
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
        poison=meter.create_counter(
            "relay.delivery.poison", "{message}", "Malformed or unknown messages dead-lettered"
        ),
    )


def _repair_instruments(meter: Meter) -> _RepairInstruments:
    """The consumer's counters of repairs beyond one delivery: destinations it disabled,
    overdue rows it republished and the late originals of those."""
    return _RepairInstruments(
        destinations_disabled=meter.create_counter(
            "relay.destinations.disabled", "{destination}", "Destinations disabled, by reason"
        ),
        overdue_republished=meter.create_counter(
            "relay.overdue.republished",
            "{delivery}",
            "Queued rows not claimed in time whose message the overdue sweep republished",
        ),
        overdue_duplicates=meter.create_counter(
            "relay.overdue.duplicates",
            "{message}",
            "Messages for a republished row that came after it was final: its first message "
            "was not lost after all (harmless)",
        ),
    )


def _run_instruments(meter: Meter) -> _RunInstruments:
    """The publisher's counters and histogram: publish runs, rescue and replay."""
    return _RunInstruments(
        replays=meter.create_counter(
            "relay.replay.deliveries", "{delivery}", "Deliveries replayed by an operator"
        ),
        rescues=meter.create_counter(
            "relay.rescue.deliveries", "{delivery}", "Deliveries republished by rescue"
        ),
        scheduler_lag=_seconds_histogram(
            meter, "relay.scheduler.lag", "Intended fire time to publish run start", _LAG_BUCKETS
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
    )


def _seconds_histogram(
    meter: Meter, name: str, description: str, buckets: Iterable[float]
) -> Histogram:
    return meter.create_histogram(
        name, "s", description, explicit_bucket_boundaries_advisory=list(buckets)
    )


@dataclass
class Telemetry:
    """A process's providers and what it records into."""

    meter_provider: MeterProvider
    tracer_provider: TracerProvider
    metrics: Metrics

    @property
    def tracer(self) -> trace.Tracer:
        return self.tracer_provider.get_tracer("reminder-relay")

    def shutdown(self) -> None:
        """Flush and stop exporters (the publisher calls this before it exits)."""
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def setup(
    service_name: str,
    readers: list[MetricReader] | None = None,
    span_processors: list[SpanProcessor] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Telemetry:
    """Build one process's providers; add OTLP exporters when an endpoint is configured."""
    env = os.environ if environ is None else environ
    readers = list(readers or [])
    processors = list(span_processors or [])
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter: SpanExporter = OTLPSpanExporter()
        processors.append(BatchSpanProcessor(exporter))
    resource = conventions.build_resource(service_name)
    meter_provider = MeterProvider(metric_readers=readers, resource=resource)
    # Nothing exports spans: do not record them (a span per delivery costs real CPU).
    tracer_provider = TracerProvider(
        resource=resource, sampler=None if processors else sampling.ALWAYS_OFF
    )
    for processor in processors:
        tracer_provider.add_span_processor(processor)
    return Telemetry(
        meter_provider=meter_provider,
        tracer_provider=tracer_provider,
        metrics=Metrics.create(meter_provider.get_meter("reminder-relay")),
    )


_NOT_SNAKE = re.compile(r"[^a-z0-9]+")


def label_value(reason: str) -> str:
    """A low-cardinality, snake_case label value: the fixed part of a reason, before ``:``.

    ``"rate budget exhausted or paused"`` -> ``rate_budget_exhausted_or_paused``,
    ``"unsupported schema version: 7"`` -> ``unsupported_schema_version``.
    """
    return _NOT_SNAKE.sub("_", reason.split(":")[0].lower()).strip("_") or "unknown"


def noop() -> Metrics:
    """Instruments that record nowhere (tools and tests that do not export)."""
    return Metrics.create(otel_metrics.NoOpMeterProvider().get_meter("reminder-relay"))


def is_recording(tracer: trace.Tracer) -> bool:
    """Whether spans from this tracer can be recorded (an SDK tracer that samples)."""
    if isinstance(tracer, trace.NoOpTracer):
        return False
    sampler = getattr(tracer, "sampler", None)
    return sampler is not sampling.ALWAYS_OFF


def noop_tracer() -> trace.Tracer:
    return trace.NoOpTracerProvider().get_tracer("reminder-relay")


# --- trace context in AMQP headers (W3C traceparent/tracestate) ----------------------

TRACE_HEADERS = ("traceparent", "tracestate")


def inject_headers(context: Context | None = None) -> dict[str, Any]:
    """Headers carrying the current (or given) span context to the consumer."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return {k: v for k, v in carrier.items() if k in TRACE_HEADERS}


def extract_context(headers: Mapping[str, Any] | None) -> Context:
    """The producer's span context from a message's headers (empty if none)."""
    carrier = {k: str(v) for k, v in (headers or {}).items() if k in TRACE_HEADERS}
    return propagate.extract(carrier)


def links_from(headers: Mapping[str, Any] | None) -> list[trace.Link]:
    """A link to the producer's span (the publish run) carried in a message's headers."""
    producer = trace.get_current_span(extract_context(headers)).get_span_context()
    return [trace.Link(producer)] if producer.is_valid else []


def trace_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """Just the trace headers of a message, to carry them onto a parked copy."""
    return {k: v for k, v in (headers or {}).items() if k in TRACE_HEADERS}
