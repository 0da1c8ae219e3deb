"""One redaction for the CLI and the console: ``service.ops.redaction`` shows a webhook as
its scheme and host, an e-mail address or phone number not at all, and text from outside
redacted, on one line, bounded. The same cases run through ``relay deliveries show``'s
document and the console's rows (pages and /api/v1): both show exactly the same."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from service.ops import deliveries, redaction
from service.ops.console import data

LONG_REPLY = "unknown user dr.who@clinic.example\n call +4915112345678 or see https://x.example/a "

# (channel, destination as stored, as shown)
DESTINATIONS = [
    ("webhook", "https://clinic.example:8443/h/t0k3n?x=1", "https://clinic.example:8443"),
    ("webhook", "http://127.0.0.1:9/hooks/<script>alert(1)</script>", "http://127.0.0.1:9"),
    ("webhook", "https://[2001:db8::1]/h/secret", "https://[2001:db8::1]"),
    ("email", "dr.who@clinic.example", "(email recipient not shown)"),
    ("sms", "+4915112345678", "(sms recipient not shown)"),
    (None, "https://gone.example/h/t0k3n", "https://gone.example"),  # disabled, no reminder
    (None, "someone@example.com", "(recipient not shown)"),
    ("sms", None, None),
]

# (text from outside as stored, as shown)
TEXTS = [
    (LONG_REPLY + "y" * 500, None),  # checked by its properties below
    (
        '{"error": "no such user", "to": "+4915112345678"}',
        '{"error": "no such user", "to": "<phone>"}',
    ),
    ("<script>alert(1)</script>\r\n\tok", "<script>alert(1)</script> ok"),
    ("see https://partner.example/status?key=abc", "see <url>"),
    (None, None),
]


def _stored_row(channel: str | None, destination: str | None, text: str | None) -> dict[str, Any]:
    """A ``delivery_show`` row as the database returns it (what the CLI reads)."""
    row: dict[str, Any] = defaultdict(lambda: None)
    row.update(
        id=1,
        source="reminder",
        channel=channel,
        destination=destination,
        last_error=text,
        receipt=None,
    )
    return row


def _attempt(text: str | None) -> dict[str, Any]:
    return {
        "attempt": 1,
        "started_at": None,
        "finished_at": None,
        "latency_ms": 12.0,
        "outcome": "rejected",
        "http_status": 400,
        "error": text,
        "response_excerpt": text,
        "possibly_delivered": False,
        "stale": False,
        "provider_message_id": None,
    }


@pytest.mark.parametrize(("channel", "stored", "shown"), DESTINATIONS)
def test_the_cli_and_the_console_show_a_destination_alike(
    channel: str | None, stored: str | None, shown: str | None
) -> None:
    assert redaction.destination(channel, stored) == shown
    cli = deliveries.story(_stored_row(channel, stored, None), [], [], [])  # type: ignore[arg-type]
    console = data.shown_row({"channel": channel, "destination": stored})
    assert cli["destination"] == console["destination"] == shown
    revealed = data.shown_row({"channel": channel, "destination": stored}, reveal=True)
    assert revealed["destination"] == stored  # a recorded reveal shows it whole


@pytest.mark.parametrize(("stored", "shown"), TEXTS)
def test_the_cli_and_the_console_show_text_from_outside_alike(
    stored: str | None, shown: str | None
) -> None:
    expected = redaction.text(stored)
    if shown is not None:
        assert expected == shown
    cli = deliveries.story(
        _stored_row("webhook", None, stored),  # type: ignore[arg-type]
        [_attempt(stored)],  # type: ignore[list-item]
        [{"reason": stored}],  # a provider's receipt: its words are text from outside too
        [{"error": stored}],  # and so is a reconciliation's error
    )
    console = data.shown_row({"last_error": stored, "channel": "webhook"})
    attempt = data.shown_row(_attempt(stored))
    assert cli["last_error"] == console["last_error"] == expected
    (history,) = cli["attempt_history"]
    assert history["reply_excerpt"] == attempt["response_excerpt"] == expected
    assert history["error"] == attempt["error"] == expected
    assert cli["receipts"][0]["reason"] == cli["reconciliations"][0]["error"] == expected


def test_text_from_outside_is_redacted_flattened_and_bounded() -> None:
    cleaned = redaction.text(LONG_REPLY + "y" * 500)
    assert cleaned is not None
    assert "dr.who" not in cleaned and "+4915" not in cleaned and "x.example" not in cleaned
    assert "\n" not in cleaned and len(cleaned) == redaction.EXCERPT_LIMIT
    assert cleaned.endswith("…")
