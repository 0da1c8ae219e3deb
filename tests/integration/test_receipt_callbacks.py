"""What `relay receipts` refuses, and how receipts converge: callbacks that are unsigned,
badly signed, too old, about no known message or of an unknown kind change nothing; a
receipt that comes before the outcome is written, twice, or out of order ends in the same
state as one that came once, in order."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import asyncpg
import pytest

from service.ops import email_provider, sms_provider
from service.ops.receipts_server import EMAIL_PATH, SMS_PATH
from service.receipt_signatures import twilio_signature
from service.settings import Settings
from tests.support import relay as rs
from tests.support.providers import EMAIL_SECRET, Providers, providers


def _email(reminder_id: str, address: str) -> str:
    payload = {"subject": f"Report {reminder_id}", "text": "Your daily report"}
    return rs.line(reminder_id, address, channel="email", payload=payload)


@pytest.fixture
async def accepted(settings: Settings, pool: asyncpg.Pool) -> AsyncIterator[Providers]:
    """Two e-mails the provider accepted, with no callback sent yet."""
    async with providers(settings) as p:
        url = p.email.webhook_url
        p.email.webhook_url = None  # hold the callbacks: the test posts them itself
        await rs.load(pool, [_email("a", "ann@example.com"), _email("b", "bo@example.com")])
        assert (await rs.relay(p.settings, "publish")).code == 0
        async with rs.consumer_in_process(p.settings):

            async def both() -> bool:
                return await rs.states(pool) == {"accepted": 2}

            await rs.wait_for(both, 60, "both e-mails accepted")
        p.email.webhook_url = url
        yield p


async def _ledger(pool: asyncpg.Pool) -> tuple[Any, ...]:
    states = await pool.fetch("SELECT id, state::text, settled_at FROM deliveries ORDER BY id")
    receipts = await pool.fetchval("SELECT count(*) FROM receipts")
    return tuple(tuple(r) for r in states), receipts


async def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers=headers) as a,
    ):
        return a.status


def _event(kind: str, email_id: str) -> bytes:
    data = {"email_id": email_id, "tags": {"relay_delivery": "1"}}
    return json.dumps(
        {"type": kind, "created_at": datetime.now(UTC).isoformat(), "data": data}
    ).encode()


async def test_unsigned_badly_signed_stale_unknown_callbacks_are_refused_and_change_nothing(
    accepted: Providers, pool: asyncpg.Pool
) -> None:
    url = accepted.receipts_url + EMAIL_PATH
    email_id = accepted.email.emails[0]["id"]
    before = await _ledger(pool)
    body = _event("email.delivered", email_id)
    now = datetime.now(UTC)
    signed = email_provider.sign_svix(EMAIL_SECRET, body, "msg_1", now)
    other_secret = "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo="
    cases = {
        "unsigned": (body, {"Content-Type": "application/json"}, 401),
        "wrong secret": (body, email_provider.sign_svix(other_secret, body, "msg_1", now), 401),
        "body changed": (body.replace(b"delivered", b"bounced"), signed, 401),
        "replayed 10 minutes later": (
            body,
            email_provider.sign_svix(EMAIL_SECRET, body, "msg_1", now - timedelta(minutes=10)),
            401,
        ),
        "unknown message": (
            (unknown := _event("email.delivered", str(uuid.uuid4())).replace(b'"1"', b'"999"')),
            email_provider.sign_svix(EMAIL_SECRET, unknown, "msg_2", now),
            404,
        ),
        "unknown event type": (
            (opened := _event("email.opened", email_id)),
            email_provider.sign_svix(EMAIL_SECRET, opened, "msg_3", now),
            422,
        ),
    }
    answers = {name: await _post(url, b, h) for name, (b, h, _) in cases.items()}
    assert answers == {name: status for name, (_, _, status) in cases.items()}
    sms_body = {"MessageSid": "SM" + "a" * 32, "MessageStatus": "delivered"}
    sms_url = f"{accepted.receipts_url}{SMS_PATH}?delivery=1"
    forged = twilio_signature("not-the-token", sms_url, sms_body.items())
    async with aiohttp.ClientSession() as session:
        for headers in ({}, {"X-Twilio-Signature": forged}):
            async with session.post(sms_url, data=sms_body, headers=headers) as answer:
                assert answer.status == 401
    assert await _ledger(pool) == before
    # The genuine one, signed and on time, is taken.
    assert await _post(url, body, signed) == 200
    state = await pool.fetchval(
        "SELECT d.state::text FROM deliveries d JOIN delivery_attempts a ON a.delivery_id = d.id"
        " WHERE a.provider_message_id = $1",
        email_id,
    )
    assert state == "delivered"


async def test_receipts_twice_or_out_of_order_converge_on_the_strongest(
    accepted: Providers, pool: asyncpg.Pool
) -> None:
    to = {e["to"][0]: e for e in accepted.email.emails}
    first, second = to["ann@example.com"], to["bo@example.com"]  # reminders a and b
    bounce = {"bounce": {"type": "Permanent", "subType": "General"}}
    # a: delivered, the same callback again (the provider's retry), then a late 'delayed'.
    assert await accepted.email.post_event(first, "email.delivered", {}, "msg_a1") == 200
    assert await accepted.email.post_event(first, "email.delivered", {}, "msg_a1") == 200
    assert await accepted.email.post_event(first, "email.delivery_delayed", {}, "msg_a2") == 200
    # b: bounced, then a delivered that came late: the bounce stands.
    assert await accepted.email.post_event(second, "email.bounced", bounce, "msg_b1") == 200
    assert await accepted.email.post_event(second, "email.delivered", {}, "msg_b2") == 200
    rows = await pool.fetch(
        "SELECT reminder_id, state::text AS state, last_error FROM deliveries ORDER BY id"
    )
    assert [(r["reminder_id"], r["state"]) for r in rows] == [("a", "delivered"), ("b", "bounced")]
    assert rows[1]["last_error"] == "bounced: Permanent/General"
    kept = await pool.fetch("SELECT event_key FROM receipts ORDER BY id")
    assert [r["event_key"] for r in kept] == ["msg_a1", "msg_a2", "msg_b1", "msg_b2"]
    with pytest.raises(asyncpg.RaiseError, match="append-only"):
        await pool.execute("UPDATE receipts SET outcome = 'sent'")


async def test_a_receipt_before_the_outcome_write_settles_the_row_once_it_is_written(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    async with providers(settings) as p:
        p.email.callback_before_answer = True  # every event is posted before the 2xx
        p.sms.callback_before_answer = True
        await rs.load(
            pool,
            [
                _email("mail", "ann@example.com"),
                rs.line("text", "+14155550123", channel="sms", payload={"body": "hi"}),
            ],
        )
        assert (await rs.relay(p.settings, "publish")).code == 0
        async with rs.consumer_in_process(p.settings):

            async def delivered() -> bool:
                return await rs.states(pool) == {"delivered": 2}

            await rs.wait_for(delivered, 60, "both delivered by receipts that came first")
    order = await pool.fetch(
        "SELECT d.reminder_id, min(r.received_at) < min(a.finished_at) AS receipt_first"
        " FROM deliveries d JOIN receipts r ON r.delivery_id = d.id"
        " JOIN delivery_attempts a ON a.delivery_id = d.id GROUP BY 1"
    )
    assert {r["reminder_id"]: r["receipt_first"] for r in order} == {"mail": True, "text": True}
    assert [s for _, s in p.email.callbacks] == [200, 200]
    assert [s for _, s in p.sms.callbacks] == [200, 200, 200]
    assert sms_provider.ACCOUNT_SID  # the provider's own account signed them
