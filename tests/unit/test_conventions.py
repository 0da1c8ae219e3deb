"""Conventions of the telemetry and the logs, checked without I/O: the OpenTelemetry
resource from the SDK's environment detection, snake_case label values, RFC 3339 UTC log
times, and library loggers through the same JSON formatter."""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from service import conventions, logs, telemetry


@pytest.fixture
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_resource_uses_the_default_service_name_only_when_the_environment_names_none(
    clean_otel_env: pytest.MonkeyPatch,
) -> None:
    attributes = conventions.build_resource("relay-consume").attributes
    assert attributes["service.name"] == "relay-consume"
    assert attributes["service.version"] == conventions.version()
    assert attributes["telemetry.sdk.name"] == "opentelemetry"


def test_resource_honours_otel_service_name(clean_otel_env: pytest.MonkeyPatch) -> None:
    clean_otel_env.setenv("OTEL_SERVICE_NAME", "relay-prod")
    assert conventions.build_resource("relay-consume").attributes["service.name"] == "relay-prod"


def test_resource_honours_otel_resource_attributes(clean_otel_env: pytest.MonkeyPatch) -> None:
    clean_otel_env.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        "service.name=from-attrs,service.version=9.9,k8s.namespace.name=relay",
    )
    attributes = conventions.build_resource("relay-publish").attributes
    assert attributes["service.name"] == "from-attrs"
    assert attributes["service.version"] == "9.9"
    assert attributes["k8s.namespace.name"] == "relay"


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("rate budget exhausted or paused", "rate_budget_exhausted_or_paused"),
        ("circuit half-open", "circuit_half_open"),
        ("attempts exhausted", "attempts_exhausted"),
        ("invalid message: bad field(s) delivery_id", "invalid_message"),
        ("unsupported schema version: 7", "unsupported_schema_version"),
        ("Channel Not Configured", "channel_not_configured"),
        ("rejected", "rejected"),
        (":", "unknown"),
    ],
)
def test_label_values_are_the_snake_case_fixed_part_of_a_reason(reason: str, label: str) -> None:
    assert telemetry.label_value(reason) == label


@pytest.fixture
def json_stream() -> Iterator[io.StringIO]:
    """``logs.setup`` into a buffer; every logger it touches is restored afterwards."""
    names = ["", "relay", "py.warnings", *logs.LIBRARY_LOGGERS]
    saved = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level) for n in names}
    propagate = {n: logging.getLogger(n).propagate for n in names}
    stream = io.StringIO()
    logs.setup("INFO", stream)
    try:
        yield stream
    finally:
        logging.captureWarnings(False)
        for n, (handlers, level) in saved.items():
            logger = logging.getLogger(n)
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate[n]


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_log_time_is_rfc3339_utc_with_milliseconds(json_stream: io.StringIO) -> None:
    logs.get("test").info("hello", extra={"event": "test"})
    (entry,) = _lines(json_stream)
    time = str(entry["time"])
    assert time.endswith("Z") and "T" in time and len(time) == len("2026-12-01T04:07:34.636Z")
    parsed = datetime.fromisoformat(time)
    assert parsed.tzinfo is not None and parsed.utcoffset() == UTC.utcoffset(None)
    assert abs((datetime.now(UTC) - parsed).total_seconds()) < 3600
    assert entry["level"] == "INFO" and entry["logger"] == "relay.test"


def test_library_loggers_go_through_the_same_json_formatter(json_stream: io.StringIO) -> None:
    # A handler a library (or an application) attached earlier would print plain text.
    plain = logging.StreamHandler(json_stream)
    logging.getLogger("aio_pika").addHandler(plain)
    logs.setup("INFO", json_stream)
    for name in ("aio_pika.robust_connection", "aiormq.connection", "asyncio", "aiohttp.client"):
        logging.getLogger(name).warning("library line from %s", name)
    logging.getLogger("aiormq.connection").info("below WARNING: not written")
    entries = _lines(json_stream)  # every line parses: no plain text among them
    assert [e["logger"] for e in entries] == [
        "aio_pika.robust_connection",
        "aiormq.connection",
        "asyncio",
        "aiohttp.client",
    ]
    assert all(str(e["time"]).endswith("Z") and e["level"] == "WARNING" for e in entries)


def test_python_warnings_come_out_as_json_lines(json_stream: io.StringIO) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("something is deprecated", DeprecationWarning, stacklevel=1)
    (entry,) = _lines(json_stream)
    assert entry["logger"] == "py.warnings" and entry["level"] == "WARNING"
    assert "something is deprecated" in str(entry["message"])
