"""The door (service.entry): the checks every way in shares, and that they are the send-time
limits of the channel adapters: what enters is never refused for its shape when sent."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.channels import email, http, sms, webhook
from consumer.channels.base import OutcomeKind, SendRequest
from service import entry, ledger, limits, netpolicy
from service.ledger import admission
from service.ops import reminder_lines, reminders

LOOPBACK = netpolicy.parse_networks("127.0.0.0/8")


def _request(destination: str, payload: dict[str, Any], key: str = "k-1") -> SendRequest:
    return SendRequest(
        delivery_id=1,
        idempotency_key=key,
        destination=destination,
        payload=payload,
        attempt=1,
        occurrence_at=datetime(2030, 1, 1, tzinfo=UTC),
    )


def _webhook_payload(body_bytes: int) -> dict[str, str]:
    """A payload whose compact JSON is exactly ``body_bytes`` long."""
    payload = {"blob": ""}
    payload["blob"] = "x" * (body_bytes - len(json.dumps(payload, separators=(",", ":"))))
    return payload


# ---------------------------------------------------------------- the limits are shared


def test_the_adapters_default_to_the_limits_entry_checks() -> None:
    assert webhook.WebhookConfig().max_request_bytes == limits.WEBHOOK_MAX_BODY_BYTES
    config = email.EmailConfig(api_key="k", sender="a@b.example")
    assert config.max_request_bytes == limits.EMAIL_MAX_REQUEST_BYTES
    assert sms.MAX_BODY_CHARS == limits.SMS_MAX_BODY_CHARS


async def test_webhook_body_at_the_limit_enters_and_one_byte_more_is_refused_by_both() -> None:
    at_limit = _webhook_payload(limits.WEBHOOK_MAX_BODY_BYTES)
    over = _webhook_payload(limits.WEBHOOK_MAX_BODY_BYTES + 1)
    destination = "https://1.1.1.1/hooks"
    assert entry.payload_problem("webhook", at_limit, destination) is None
    assert "for a webhook" in str(entry.payload_problem("webhook", over, destination))
    channel = webhook.WebhookChannel(webhook.WebhookConfig())
    try:
        outcome = await channel.send(_request(destination, over))
    finally:
        await channel.close()
    assert (outcome.kind, outcome.error) == (OutcomeKind.REJECTED, "payload too large")


@pytest.mark.parametrize("sender", ["a@b.example", "R" * 1000 + " <a@b.example>"])
def test_an_email_that_enters_fits_the_adapters_request_limit_with_any_allowed_sender(
    sender: str,
) -> None:
    destination = "someone@example.com"
    # The largest text entry accepts for this destination.
    lo, hi = 0, limits.EMAIL_MAX_REQUEST_BYTES
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = entry.payload_problem("email", {"subject": "s", "text": "x" * mid}, destination)
        lo, hi = (mid, hi) if ok is None else (lo, mid - 1)
    payload = {"subject": "s", "text": "x" * lo}
    assert entry.payload_problem("email", payload, destination) is None
    message = email._build_message(sender, _request(destination, payload))
    data = json.dumps(message, ensure_ascii=False).encode("utf-8")
    assert len(data) <= limits.EMAIL_MAX_REQUEST_BYTES
    longer = {"subject": "s", "text": "x" * (lo + 1)}
    assert "for an e-mail" in str(entry.payload_problem("email", longer, destination))


def test_sms_body_limit_is_the_adapters() -> None:
    config = sms.SmsConfig(account_sid="AC" + "0" * 32, auth_token="t", from_number="+14155550100")
    channel = sms.SmsChannel(config)
    at_limit, over = {"body": "é" * 1600}, {"body": "😀" * 801}  # 1,602 UTF-16 units
    assert entry.payload_problem("sms", at_limit, "+14155550123") is None
    assert "too long" in str(entry.payload_problem("sms", over, "+14155550123"))
    assert channel._form(_request("+14155550123", over)) == "payload too large"
    assert isinstance(channel._form(_request("+14155550123", at_limit)), dict)


def test_every_key_built_from_an_accepted_id_is_one_the_adapters_send() -> None:
    longest_id = "x" * entry.MAX_REMINDER_ID_CHARS
    assert entry.identifier_problem(longest_id, entry.MAX_REMINDER_ID_CHARS) is None
    at = datetime(2030, 12, 31, 23, 59, tzinfo=UTC)
    for channel in entry.CHANNELS:
        assert http.rejected_key(admission.schedule_key(longest_id, at, channel)) is None
    longest_key = "k:" * (entry.MAX_OUTBOX_KEY_CHARS // 2) + "k" * (entry.MAX_OUTBOX_KEY_CHARS % 2)
    assert entry.identifier_problem(longest_key, entry.MAX_OUTBOX_KEY_CHARS) is None
    assert http.rejected_key(ledger.outbox_key(longest_key)) is None


# ------------------------------------------------------------------------ identifiers


@pytest.mark.parametrize("good", ["a", "clinic-42-daily", "hold:42:expired:email", "A.b_C-9"])
def test_identifiers_of_the_alphabet_are_accepted(good: str) -> None:
    assert entry.identifier_problem(good, 200) is None


@pytest.mark.parametrize(
    "bad", ["", "clinic 42", "café", "a@b", "a+b", "a/b", 'a"b', "a\\b", "tab\there", "x" * 201]
)
def test_identifiers_outside_the_alphabet_or_too_long_are_refused(bad: str) -> None:
    assert entry.identifier_problem(bad, 200) is not None


# ----------------------------------------------------------------------- destinations


@pytest.mark.parametrize(
    ("channel", "destination", "problem"),
    [
        ("email", "a@example.com", None),
        ("email", "not-an-email-address", "must have an @-sign"),
        ("email", "Name <a@example.com>", "display name"),
        ("email", "a@localhost", "not a valid e-mail address"),
        ("sms", "+14155550123", None),
        ("sms", "555-1234", "not an E.164 phone number"),
        ("sms", "+1 415 555 0123", "no spaces, dashes or brackets"),
        ("sms", "+15551234567", "not a valid phone number"),
        ("webhook", "https://partner.example/hooks", None),
        ("webhook", "http://127.0.0.1:9/hooks", None),
        ("webhook", "http://10.0.0.1/hooks", "ssrf: private address"),
        ("webhook", "http://partner.example/a\x00b", "control character"),
        ("webhook", " https://partner.example", "leading or trailing spaces"),
        ("fax", "123", "unknown channel"),
    ],
)
def test_destinations_are_checked_per_channel(
    channel: str, destination: str, problem: str | None
) -> None:
    found = entry.destination_problem(channel, destination, LOOPBACK)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found
        assert destination.strip() not in found or not destination.strip()


# ---------------------------------------------------------------------------- payloads


def test_json_depth_skips_strings_and_escaped_quotes() -> None:
    assert entry.json_depth('{"a": "[[[{{{", "b": [1, {"c": "\\"]]]"}]}') == 3
    assert entry.json_depth("[" * 100_000 + "]" * 100_000) == 100_000
    assert entry.json_depth('"just a string"') == 0


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ({"a": "x\x00y"}, "payload.a: contains a NUL character"),
        ({"a\x00": 1}, "payload: a key contains a NUL character"),
        ({"a": ["ok", "\ud800"]}, "payload.a[1]: contains an unpaired surrogate"),
        ({"a": float("nan")}, "payload.a: not a finite number"),
        ({"a": float("inf")}, "payload.a: not a finite number"),
        ({"a": b"bytes"}, "payload.a: not a JSON value (bytes)"),
        ({1: "int key"}, "payload: object keys must be strings"),
        ({"a": 10**5000}, "payload: not JSON-serializable"),
    ],
)
def test_payload_values_that_cannot_be_stored_are_refused(
    payload: dict[Any, Any], problem: str
) -> None:
    found = entry.payload_problem("webhook", payload, "https://1.1.1.1/")
    assert found is not None and found.startswith(problem), found


def test_depth_is_bounded_at_32_levels_without_recursion() -> None:
    def nested(depth: int) -> dict[str, Any]:
        payload: dict[str, Any] = {}
        for _ in range(depth - 1):
            payload = {"a": payload}
        return payload

    assert entry.payload_problem("webhook", nested(32), "https://1.1.1.1/") is None
    deep = entry.payload_problem("webhook", nested(33), "https://1.1.1.1/")
    assert deep is not None and deep.endswith("nested deeper than 32 levels")
    assert entry.payload_problem("webhook", nested(200_000), "https://1.1.1.1/") is not None


# ---------------------------------------------------- the loader never crashes on a line

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(st.text(), _JSON),
        "channel": st.sampled_from(["webhook", "email", "sms", "fax"]) | _JSON,
        "destination": st.sampled_from(
            ["http://127.0.0.1:9/h", "a@example.com", "+14155550123", "http://[::1", ""]
        )
        | st.text(),
        "payload": st.dictionaries(st.text(), _JSON, max_size=3) | _JSON,
        "due_at": st.sampled_from(
            ["2030-01-01T00:00:00+00:00", "0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00"]
        )
        | _JSON,
        "daily_at": st.sampled_from(["06:00", "24:00", "6:00"]) | _JSON,
        "cron": st.sampled_from(["0 6 * * *", "* * * *", "0 0 30 2 *", "@daily"]) | _JSON,
        "timezone": st.sampled_from(["Europe/Berlin", "Mars/Olympus", "", "../x"]) | _JSON,
        "stale_after": st.sampled_from(["PT2H", 60, -1, "x"]) | _JSON,
        "provider": st.text() | _JSON,
        "urgent": _JSON,
    },
)


@settings(max_examples=300, deadline=None)
@given(line=_FIELDS.map(json.dumps) | st.text() | st.binary())
def test_any_line_is_loaded_or_reported_never_raised(line: str | bytes) -> None:
    problems = reminder_lines.Problems()
    now = datetime(2030, 1, 1, tzinfo=UTC)
    reminders.parse_lines([(1, line)], now, LOOPBACK, set(), problems)
    assert problems.count <= 1
