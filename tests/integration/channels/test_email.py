"""The email adapter (Resend-shaped API) against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from pydantic import SecretStr

from consumer.channels.base import OutcomeKind
from consumer.channels.email import EmailChannel, EmailConfig
from tests.support.http_harness import (
    KEY,
    Recorder,
    assert_no_leak,
    json_reply,
    make_request,
    raw_server,
    reply,
    serve,
)

API_KEY = "re_test_4f9b2c"
RECIPIENT = "ada@example.org"


@asynccontextmanager
async def email_channel(srv: Recorder, **overrides: Any) -> AsyncIterator[EmailChannel]:
    values: dict[str, Any] = {
        "base_url": srv.url("/"),
        "api_key": SecretStr(API_KEY),
        "sender": "Reminders <reminders@relay.example>",
        "timeout_seconds": 2.0,
    }
    values.update(overrides)
    channel = EmailChannel(EmailConfig(**values))
    try:
        yield channel
    finally:
        await channel.close()


EMAIL_PAYLOAD = {"subject": "Dentist at 9:00", "text": "See you tomorrow.", "html": "<p>See</p>"}


async def test_email_request_shape_and_receipt() -> None:
    async with (
        serve(json_reply(200, {"id": "49a3999c-0ce1-4ea6-ab68-afcd6dc2e794"})) as srv,
        email_channel(srv) as ch,
    ):
        outcome = await ch.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
    assert outcome.kind is OutcomeKind.ACCEPTED
    assert outcome.receipt == "49a3999c-0ce1-4ea6-ab68-afcd6dc2e794"
    assert outcome.message_id == "49a3999c-0ce1-4ea6-ab68-afcd6dc2e794"
    assert outcome.response_excerpt is None
    [seen] = srv.seen
    assert seen.method == "POST"
    assert seen.path == "/emails"
    assert seen.headers["Authorization"] == f"Bearer {API_KEY}"
    assert seen.headers["Idempotency-Key"] == KEY
    assert seen.headers["Content-Type"] == "application/json"
    assert json.loads(seen.body) == {
        "from": "Reminders <reminders@relay.example>",
        "to": [RECIPIENT],
        "subject": "Dentist at 9:00",
        "text": "See you tomorrow.",
        "html": "<p>See</p>",
        # the same for every attempt of the delivery: receipts find it by this tag
        "tags": [{"name": "relay_delivery", "value": "42"}],
    }
    assert_no_leak(outcome, RECIPIENT, API_KEY)


async def test_email_html_is_optional_and_api_key_may_be_str() -> None:
    payload = {"subject": "s", "text": "t"}
    async with serve(json_reply(200, {"id": "e1"})) as srv, email_channel(srv, api_key="k") as ch:
        outcome = await ch.send(make_request(RECIPIENT, payload))
    assert outcome.receipt == "e1"
    assert "html" not in json.loads(srv.seen[0].body)
    assert srv.seen[0].headers["Authorization"] == "Bearer k"


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"text": "t"}, "payload missing 'subject'"),
        ({"subject": "s"}, "payload missing 'text'"),
        ({"subject": "a\r\nBcc: x@y.z", "text": "t"}, "payload invalid 'subject'"),
        ({"subject": "s", "text": 5}, "payload invalid 'text'"),
        ({"subject": "s", "text": "t", "html": ["x"]}, "payload invalid 'html'"),
    ],
)
async def test_email_payload_problems_rejected_without_request(
    payload: dict[str, Any], error: str
) -> None:
    async with serve(json_reply(200, {"id": "x"})) as srv, email_channel(srv) as ch:
        outcome = await ch.send(make_request(RECIPIENT, payload))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.error == error
    assert outcome.possibly_delivered is False
    assert srv.seen == []


async def test_email_invalid_recipient_rejected() -> None:
    async with serve(json_reply(200, {"id": "x"})) as srv, email_channel(srv) as ch:
        outcome = await ch.send(make_request("a@b.c, evil@x.y", EMAIL_PAYLOAD))
    assert outcome.error == "invalid recipient address"
    assert srv.seen == []


async def test_email_provider_error_reported_by_name_only() -> None:
    body = {
        "statusCode": 403,
        "name": "validation_error",
        "message": f"You can only send testing emails to your own email address ({RECIPIENT}).",
    }
    async with serve(json_reply(403, body)) as srv, email_channel(srv) as ch:
        outcome = await ch.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.http_status == 403
    assert outcome.error == "resend validation_error"
    assert outcome.response_excerpt == "validation_error"
    assert_no_leak(outcome, RECIPIENT, "testing emails")


async def test_email_429_uses_retry_after_then_ratelimit_reset() -> None:
    limited = {"statusCode": 429, "name": "rate_limit_exceeded", "message": "Too many"}
    async with (
        serve(json_reply(429, limited, {"retry-after": "2"})) as srv,
        email_channel(srv) as ch,
    ):
        with_retry_after = await ch.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
    async with (
        serve(json_reply(429, limited, {"ratelimit-reset": "5"})) as srv,
        email_channel(srv) as ch,
    ):
        with_reset = await ch.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
    assert with_retry_after.kind is OutcomeKind.THROTTLED
    assert with_retry_after.retry_after_seconds == 2.0
    assert with_retry_after.error == "resend rate_limit_exceeded"
    assert with_reset.kind is OutcomeKind.THROTTLED
    assert with_reset.retry_after_seconds == 5.0


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("concurrent_idempotent_requests", OutcomeKind.RETRY),
        ("invalid_idempotent_request", OutcomeKind.REJECTED),
    ],
)
async def test_email_409_idempotency_conflicts(name: str, kind: OutcomeKind) -> None:
    body = {"statusCode": 409, "name": name, "message": "..."}
    async with serve(json_reply(409, body)) as srv, email_channel(srv) as ch:
        outcome = await ch.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
    assert outcome.kind is kind
    assert outcome.error == f"resend {name}"


async def test_email_5xx_retry_and_gateway_page_excerpted() -> None:
    async with serve(reply(502, "<html>Bad Gateway</html>" + "x" * 2000)) as srv:
        async with email_channel(srv, max_response_excerpt_bytes=24) as ch:
            outcome = await ch.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.error == "http 502"
    assert outcome.response_excerpt == "<html>Bad Gateway</html>"


async def test_email_timeout_is_retry() -> None:
    async with raw_server() as raw:
        config = EmailConfig(
            base_url=f"http://127.0.0.1:{raw.port}",
            api_key=API_KEY,
            sender="r@relay.example",
            timeout_seconds=0.5,
        )
        channel = EmailChannel(config)
        try:
            outcome = await channel.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
        finally:
            await channel.close()
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.error == "timeout"
    assert_no_leak(outcome, API_KEY, RECIPIENT)


def test_email_config_hides_key() -> None:
    config = EmailConfig(base_url="https://api.resend.com/", api_key=API_KEY, sender="a@b.c")
    assert API_KEY not in repr(config)
    assert config.base_url == "https://api.resend.com"
    with pytest.raises(ValueError, match="base_url"):
        EmailConfig(base_url="ftp://x", api_key=API_KEY, sender="a@b.c")
