"""The SMS adapter (Twilio-shaped Messages API) against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qs

import pytest
from pydantic import SecretStr

from consumer.channels.base import OutcomeKind
from consumer.channels.sms import SmsChannel, SmsConfig
from tests.support.http_harness import (
    KEY,
    Recorder,
    Responder,
    assert_no_leak,
    json_reply,
    make_request,
    reply,
    serve,
)

ACCOUNT_SID = "AC" + "0123456789abcdef" * 2
AUTH_TOKEN = "twilio-auth-token-7c1d"
FROM = "+15005550006"
TO = "+14155550123"
SERVICE_SID = "MG" + "fedcba9876543210" * 2


@asynccontextmanager
async def sms_channel(srv: Recorder, **overrides: Any) -> AsyncIterator[SmsChannel]:
    values: dict[str, Any] = {
        "base_url": srv.url("/"),
        "account_sid": ACCOUNT_SID,
        "auth_token": SecretStr(AUTH_TOKEN),
        "from_number": FROM,
        "timeout_seconds": 2.0,
    }
    values.update(overrides)
    channel = SmsChannel(SmsConfig(**values))
    try:
        yield channel
    finally:
        await channel.close()


def twilio_created(sid: str = "SM" + "a" * 32) -> Responder:
    return json_reply(201, {"sid": sid, "status": "queued", "to": TO, "body": "Dentist at 9"})


async def test_sms_request_shape_and_receipt() -> None:
    async with serve(twilio_created()) as srv, sms_channel(srv) as ch:
        outcome = await ch.send(make_request(TO, {"body": "Dentist at 9 & bring card ✓"}))
    assert outcome.kind is OutcomeKind.ACCEPTED
    assert outcome.http_status == 201
    assert outcome.receipt == "SM" + "a" * 32
    assert outcome.possibly_delivered is True
    assert outcome.response_excerpt is None
    [seen] = srv.seen
    assert seen.method == "POST"
    assert seen.path == f"/2010-04-01/Accounts/{ACCOUNT_SID}/Messages.json"
    assert seen.headers["Content-Type"] == "application/x-www-form-urlencoded"
    scheme, _, token = seen.headers["Authorization"].partition(" ")
    assert scheme == "Basic"
    assert base64.b64decode(token).decode() == f"{ACCOUNT_SID}:{AUTH_TOKEN}"
    form = {k: v[0] for k, v in parse_qs(seen.body.decode(), strict_parsing=True).items()}
    assert form == {"To": TO, "From": FROM, "Body": "Dentist at 9 & bring card ✓"}
    assert seen.headers["Idempotency-Key"] == KEY
    assert_no_leak(outcome, TO, AUTH_TOKEN, "Dentist")


async def test_sms_messaging_service_instead_of_from() -> None:
    async with (
        serve(twilio_created()) as srv,
        sms_channel(srv, from_number=None, messaging_service_sid=SERVICE_SID) as ch,
    ):
        outcome = await ch.send(make_request(TO, {"body": "hi"}))
    assert outcome.kind is OutcomeKind.ACCEPTED
    form = parse_qs(srv.seen[0].body.decode())
    assert form["MessagingServiceSid"] == [SERVICE_SID]
    assert "From" not in form


async def test_sms_twilio_error_code_rejected_without_message() -> None:
    body = {
        "code": 21211,
        "message": f"The 'To' number {TO} is not a valid phone number.",
        "more_info": "https://www.twilio.com/docs/errors/21211",
        "status": 400,
    }
    async with serve(json_reply(400, body)) as srv, sms_channel(srv) as ch:
        outcome = await ch.send(make_request(TO, {"body": "hi"}))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.http_status == 400
    assert outcome.error == "twilio 21211"
    assert outcome.response_excerpt == "twilio 21211"
    assert_no_leak(outcome, TO, "valid phone")


async def test_sms_429_throttled_and_5xx_retry() -> None:
    busy = {"code": 20429, "message": "Too Many Requests", "status": 429}
    async with serve(json_reply(429, busy, {"Retry-After": "3"})) as srv, sms_channel(srv) as ch:
        throttled = await ch.send(make_request(TO, {"body": "hi"}))
    async with serve(reply(503, "unavailable")) as srv, sms_channel(srv) as ch:
        retry = await ch.send(make_request(TO, {"body": "hi"}))
    assert throttled.kind is OutcomeKind.THROTTLED
    assert throttled.error == "twilio 20429"
    assert throttled.retry_after_seconds == 3.0
    assert retry.kind is OutcomeKind.RETRY
    assert retry.error == "http 503"


@pytest.mark.parametrize(
    ("destination", "payload", "error"),
    [
        (TO, {}, "payload missing 'body'"),
        (TO, {"body": ""}, "payload invalid 'body'"),
        (TO, {"body": 12}, "payload invalid 'body'"),
        (TO, {"body": "x" * 1601}, "payload too large"),
        (TO, {"body": "😀" * 801}, "payload too large"),  # 1602 UTF-16 units
        ("4155550123", {"body": "hi"}, "invalid recipient number"),
        ("+1415555\n0123", {"body": "hi"}, "invalid recipient number"),
    ],
)
async def test_sms_request_problems_rejected_without_request(
    destination: str, payload: dict[str, Any], error: str
) -> None:
    async with serve(twilio_created()) as srv, sms_channel(srv) as ch:
        outcome = await ch.send(make_request(destination, payload))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.error == error
    assert outcome.possibly_delivered is False
    assert srv.seen == []


async def test_sms_body_at_limit_is_sent() -> None:
    async with serve(twilio_created()) as srv, sms_channel(srv) as ch:
        outcome = await ch.send(make_request(TO, {"body": "x" * 1600}))
    assert outcome.kind is OutcomeKind.ACCEPTED


async def test_sms_connection_refused_is_retry_not_delivered(refused_port: int) -> None:
    config = SmsConfig(
        base_url=f"http://127.0.0.1:{refused_port}",
        account_sid=ACCOUNT_SID,
        auth_token=AUTH_TOKEN,
        from_number=FROM,
    )
    channel = SmsChannel(config)
    try:
        outcome = await channel.send(make_request(TO, {"body": "hi"}))
    finally:
        await channel.close()
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.error == "connection error"
    assert outcome.possibly_delivered is False
    assert_no_leak(outcome, AUTH_TOKEN, ACCOUNT_SID)


def test_sms_config_validation() -> None:
    config = SmsConfig(account_sid=ACCOUNT_SID, auth_token=AUTH_TOKEN, from_number=FROM)
    assert AUTH_TOKEN not in repr(config)
    with pytest.raises(ValueError, match="exactly one"):
        SmsConfig(account_sid=ACCOUNT_SID, auth_token=AUTH_TOKEN)
    with pytest.raises(ValueError, match="exactly one"):
        SmsConfig(
            account_sid=ACCOUNT_SID,
            auth_token=AUTH_TOKEN,
            from_number=FROM,
            messaging_service_sid=SERVICE_SID,
        )
    with pytest.raises(ValueError, match="account_sid"):
        SmsConfig(account_sid="AC123/../x", auth_token=AUTH_TOKEN, from_number=FROM)
