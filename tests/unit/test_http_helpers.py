"""Pure helpers shared by the HTTP adapters: Retry-After, excerpts, classification,
the idempotency-key check and the config checks."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import aiohttp
import pytest
from pydantic import SecretStr

from consumer.channels.base import OutcomeKind
from consumer.channels.http import (
    check_http_config,
    check_provider_config,
    classify_status,
    rejected_key,
    secret_value,
    transport_outcome,
)
from consumer.channels.text import excerpt, parse_retry_after, safe_token, try_json_object

NOW = datetime(2030, 5, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("   ", None),
        ("0", 0.0),
        ("120", 120.0),
        (" 7 ", 7.0),
        ("1.5", 1.5),
        ("-5", None),
        ("soon", None),
        ("1e309", None),
        ("Wed, 01 May 2030 12:02:00 GMT", 120.0),
        ("Wednesday, 01-May-30 12:00:30 GMT", 30.0),  # RFC 850 form
        ("Wed May  1 12:00:10 2030", 10.0),  # asctime form
        ("Wed, 01 May 2030 11:00:00 GMT", 0.0),  # in the past
        ("Wed, 01 May 2030 12:00:60 GMT", None),
        ("Wed, 32 May 2030 12:00:00 GMT", None),
    ],
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value, NOW) == expected


def test_parse_retry_after_with_naive_now_and_offset_date() -> None:
    naive_now = NOW.replace(tzinfo=None)
    assert parse_retry_after("Wed, 01 May 2030 12:01:00 GMT", naive_now) == 60.0
    in_two_hours = format_datetime(NOW + timedelta(hours=2), usegmt=True)
    assert parse_retry_after(in_two_hours, NOW) == 7200.0


def test_excerpt_bounds_and_sanitises() -> None:
    assert excerpt(b"", 10) is None
    assert excerpt(b"abc", 0) is None
    assert excerpt(b"abcdef", 3) == "abc"
    assert excerpt("é".encode() * 3, 3) == "é\ufffd"
    assert excerpt(b"line1\nline2\r\x1b[31m", 100) == "line1\nline2\ufffd\ufffd[31m"
    assert excerpt(b"\xff\xfe", 10) == "\ufffd\ufffd"


def test_safe_token() -> None:
    assert safe_token("SMa1b2") == "SMa1b2"
    assert safe_token("id\r\nSet-Cookie: x") == "idSet-Cookie:x"
    assert safe_token("x" * 300) == "x" * 128
    assert safe_token(21211) == "21211"
    assert safe_token(True) is None
    assert safe_token(None) is None
    assert safe_token({"a": 1}) is None
    assert safe_token("<>") is None


def test_try_json_object() -> None:
    assert try_json_object(b'{"id": "x"}') == {"id": "x"}
    assert try_json_object(b"[1]") is None
    assert try_json_object(b"<html>") is None
    assert try_json_object(b"\xff") is None


def test_secret_value() -> None:
    assert secret_value(SecretStr("k")) == "k"
    assert secret_value("k") == "k"


@pytest.mark.parametrize(
    ("status", "kind", "error"),
    [
        (301, OutcomeKind.REJECTED, "redirect not followed"),
        (302, OutcomeKind.REJECTED, "redirect not followed"),
        (307, OutcomeKind.REJECTED, "redirect not followed"),
        (400, OutcomeKind.REJECTED, "http 400"),
        (404, OutcomeKind.REJECTED, "http 404"),
        (408, OutcomeKind.RETRY, "http 408"),
        (410, OutcomeKind.REJECTED, "http 410"),
        (425, OutcomeKind.RETRY, "http 425"),
        (429, OutcomeKind.THROTTLED, "http 429"),
        (500, OutcomeKind.RETRY, "http 500"),
        (503, OutcomeKind.RETRY, "http 503"),
        (599, OutcomeKind.RETRY, "http 599"),
        (600, OutcomeKind.RETRY, "http 600: unexpected status"),
        (101, OutcomeKind.RETRY, "http 101: unexpected status"),
    ],
)
def test_classify_status_table(status: int, kind: OutcomeKind, error: str) -> None:
    outcome = classify_status(status, {}, now=NOW)
    assert outcome.kind is kind
    assert outcome.error == error
    assert outcome.http_status == status
    assert outcome.disable_destination is False
    assert outcome.possibly_delivered is True  # the server answered: it had the request


def test_classify_status_gone_and_retry_after_and_detail() -> None:
    gone = classify_status(410, {}, now=NOW, gone_disables=True)
    assert gone.kind is OutcomeKind.REJECTED
    assert gone.disable_destination is True
    assert gone.error == "410 gone: destination disabled"

    throttled = classify_status(429, {"Retry-After": "9"}, now=NOW)
    assert throttled.retry_after_seconds == 9.0
    retry = classify_status(503, {"Retry-After": "Wed, 01 May 2030 12:00:05 GMT"}, now=NOW)
    assert retry.retry_after_seconds == 5.0
    rejected = classify_status(400, {"Retry-After": "9"}, now=NOW)
    assert rejected.retry_after_seconds is None

    detailed = classify_status(422, {}, now=NOW, detail="resend validation_error")
    assert detailed.error == "resend validation_error"
    assert detailed.http_status == 422


def test_transport_outcome_mapping() -> None:
    timeout = transport_outcome(TimeoutError())
    assert (timeout.kind, timeout.error) == (OutcomeKind.RETRY, "timeout")
    assert timeout.possibly_delivered is True

    connect_timeout = transport_outcome(aiohttp.ConnectionTimeoutError())
    assert connect_timeout.error == "connect timeout"
    assert connect_timeout.possibly_delivered is False

    disconnected = transport_outcome(aiohttp.ServerDisconnectedError())
    assert disconnected.error == "connection error"
    assert disconnected.kind is OutcomeKind.RETRY
    assert disconnected.possibly_delivered is True

    secret_message = transport_outcome(aiohttp.ClientOSError(111, "http://h/tok_s3cr3t"))
    assert "tok_s3cr3t" not in repr(secret_message)


@pytest.mark.parametrize(
    ("key", "ok"),
    [
        ("reminder-42:2030-01-01T09:00:00Z", True),
        ("k", True),
        ("x" * 256, True),
        ("x" * 257, False),
        ("", False),
        ("has space", False),
        ("line\r\nbreak", False),
        ("zoë", False),
    ],
)
def test_rejected_key(key: str, ok: bool) -> None:
    outcome = rejected_key(key)
    if ok:
        assert outcome is None
    else:
        assert outcome is not None
        assert (outcome.kind, outcome.error) == (OutcomeKind.REJECTED, "invalid idempotency key")
        assert outcome.possibly_delivered is False


@dataclass(frozen=True)
class _Config:
    base_url: str = "https://api.example.com/"
    timeout_seconds: float = 1.0
    connect_timeout_seconds: float = 1.0
    connection_limit: int = 1
    max_request_bytes: int = 1
    max_response_bytes: int = 100
    max_response_excerpt_bytes: int = 100


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_seconds", 0.0),
        ("connect_timeout_seconds", float("nan")),
        ("connection_limit", -1),
        ("max_response_bytes", 0),
        ("max_request_bytes", 0),
    ],
)
def test_check_http_config_names_the_field_that_is_not_positive(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be a positive number$"):
        overrides: dict[str, Any] = {field: value}
        check_http_config(replace(_Config(), **overrides), "max_request_bytes")


def test_check_http_config_bounds_the_excerpt_by_the_read() -> None:
    check_http_config(_Config(max_response_excerpt_bytes=0))
    check_http_config(_Config(max_response_excerpt_bytes=100))
    with pytest.raises(ValueError, match="max_response_excerpt_bytes"):
        check_http_config(_Config(max_response_excerpt_bytes=101))


def test_check_provider_config_checks_and_trims_base_url() -> None:
    config = _Config()
    check_provider_config(config)
    assert config.base_url == "https://api.example.com"
    with pytest.raises(ValueError, match=r"^base_url: "):
        check_provider_config(_Config(base_url="ftp://x"))
    with pytest.raises(ValueError, match="timeout_seconds"):
        check_provider_config(_Config(timeout_seconds=0))
