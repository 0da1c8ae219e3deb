"""The consumer's per-delivery counter is summed locally and exported as a counter."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint, Sum

from service.telemetry import LocalCounter


def _points(reader: InMemoryMetricReader) -> dict[tuple[tuple[str, str], ...], int]:
    data = reader.get_metrics_data()
    assert data is not None
    (metric,) = [
        m
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "relay.delivery.attempts"
    ]
    assert metric.unit == "{attempt}"
    assert isinstance(metric.data, Sum) and metric.data.is_monotonic
    points: dict[tuple[tuple[str, str], ...], int] = {}
    for point in metric.data.data_points:
        assert isinstance(point, NumberDataPoint) and point.attributes is not None
        points[tuple(sorted((k, str(v)) for k, v in point.attributes.items()))] = int(point.value)
    return points


def test_counts_per_attribute_set_and_stays_cumulative() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    counter = LocalCounter(
        provider.get_meter("t"), "relay.delivery.attempts", "{attempt}", "Delivery attempts"
    )
    for _ in range(3):
        counter.add(1, {"channel": "webhook", "outcome": "accepted"})
    counter.add(2, {"channel": "sms", "outcome": "retry"})

    accepted = (("channel", "webhook"), ("outcome", "accepted"))
    retried = (("channel", "sms"), ("outcome", "retry"))
    assert _points(reader) == {accepted: 3, retried: 2}

    counter.add(1, {"channel": "webhook", "outcome": "accepted"})
    assert _points(reader) == {accepted: 4, retried: 2}
    provider.shutdown()
