"""Receipts beside events, against real PostgreSQL, RabbitMQ, the local providers with
`relay receipts` and a partner endpoint: one report says who did not get it of both kinds
(an e-mail accepted without a receipt, a bounced SMS, an event's delivery grouped by its
event), and ``deliveries show`` tells each row's story with its event or its receipts."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from service.settings import Settings
from tests.support import console as cs
from tests.support import relay as rs
from tests.support.providers import providers
from tests.support.receivers import keyed

__all__ = ["keyed"]  # fixtures


async def _json(settings: Settings, *args: str) -> Any:
    result = await rs.relay(settings, *args, "--json")
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


async def _text(settings: Settings, *args: str) -> str:
    result = await rs.relay(settings, *args)
    assert result.code == 0, result.stderr
    return result.stdout


async def _run_settled(pool: asyncpg.Pool) -> None:
    async def settled() -> bool:
        rows = await pool.fetch("SELECT reminder_id, state::text AS state FROM deliveries")
        return {r["reminder_id"]: r["state"] for r in rows} == {
            "quiet": "accepted",
            "gone": "bounced",
        }

    await rs.wait_for(settled, 60, "the e-mail accepted and the SMS bounced")


@pytest.mark.timeout(180)
async def test_one_report_names_the_accepted_the_bounced_and_each_event_not_delivered(
    keyed: Settings, pool: asyncpg.Pool
) -> None:
    async with providers(keyed) as p, cs.answering("no such order", status=400) as receiver:
        p.email.webhook_url = None  # this provider sends no receipts: the e-mail stays accepted
        email = {"subject": "Report", "text": "Your daily report"}
        await rs.load(
            pool,
            [
                rs.line("quiet", "ann@example.com", channel="email", payload=email),
                rs.line("gone", "+14155550000", channel="sms", payload={"body": "Hi"}),
            ],
        )
        assert (await rs.relay(p.settings, "publish")).code == 0
        async with rs.consumer_in_process(p.settings):
            await _run_settled(pool)
            event = await cs.dead_event(
                p.settings, pool, "order-1", f"{receiver}/hooks/shop", {"order": 1}
            )
    waited = p.settings.model_copy(update={"receipt_wait_seconds": 1.0})

    async def past_the_wait() -> bool:
        report = await _json(waited, "status")
        return bool(report["no_receipt"] == 1)

    await rs.wait_for(past_the_wait, 30, "the accepted e-mail past the receipt wait")
    report = await _json(waited, "status")
    assert report["event_deliveries"]["states"] == {"dead": 1}
    assert report["outbox"]["states"] == {}
    email_counts = report["runs"][0]["by_channel"]["email"]
    sms_counts = report["runs"][0]["by_channel"]["sms"]
    assert (email_counts["accepted"], email_counts["no_receipt"]) == (1, 1)
    assert (sms_counts["bounced"], sms_counts["delivered"]) == (1, 0)

    missing = await _json(waited, "status", "--missing")
    rows = {m["reminder_id"]: m for m in missing["missing"]}
    assert {name: r["state"] for name, r in rows.items()} == {
        "quiet": "accepted",
        "gone": "bounced",
    }
    assert rows["quiet"]["accepted_seconds"] >= 1.0
    assert rows["gone"]["last_error"] == "bounced: 30005"
    assert missing["outbox_missing"] == []
    [group] = missing["event_missing"]
    assert (group["event_id"], group["key"], group["event_type"]) == (
        event.event_id,
        "order-1",
        "console.test",
    )
    [undelivered] = group["missing"]
    assert (undelivered["id"], undelivered["state"]) == (event.delivery_id, "dead")
    assert undelivered["destination"] == receiver  # scheme and host, never the path

    text = await _text(waited, "status", "--missing")
    assert "accepted, no receipt after 1 s" in text
    assert "bounced: 30005" in text
    assert f"event {event.event_id} console.test order-1" in text
    summary = await _text(waited, "status")
    assert "accepted by a provider, no receipt yet: 1 (1 after 1 s)" in summary
    assert "event deliveries (no run): dead=1" in summary


async def test_deliveries_show_tells_an_events_delivery_and_a_bounced_sms_each_their_own(
    keyed: Settings, pool: asyncpg.Pool
) -> None:
    """An event's delivery went through the claim and the last check like any webhook (its
    request answered 400): its story names the event and has no receipts; the SMS's has its
    receipts and no event."""
    async with providers(keyed) as p, cs.answering("no such order", status=400) as receiver:
        await rs.load(
            pool, [rs.line("gone", "+14155550000", channel="sms", payload={"body": "Hi"})]
        )
        assert (await rs.relay(p.settings, "publish")).code == 0
        async with rs.consumer_in_process(p.settings):
            event = await cs.dead_event(
                p.settings, pool, "order-2", f"{receiver}/hooks/shop", {"order": 2}
            )
            sms_id = await pool.fetchval("SELECT id FROM deliveries WHERE reminder_id = 'gone'")

            async def bounced() -> bool:
                state = await pool.fetchval(
                    "SELECT state::text FROM deliveries WHERE id = $1", sms_id
                )
                return bool(state == "bounced")

            await rs.wait_for(bounced, 60, "the SMS bounced")
    told = await _json(p.settings, "deliveries", "show", str(event.delivery_id))
    assert told["event"]["key"] == "order-2" and told["event"]["deliveries"] == 1
    assert [a["http_status"] for a in told["attempt_history"]] == [400]
    assert (told["receipts"], told["reconciliations"], told["settled_at"]) == ([], [], None)
    sms = await _json(p.settings, "deliveries", "show", str(sms_id))
    assert sms["event"] is None and sms["settled_at"] is not None
    assert [r["outcome"] for r in sms["receipts"]][-1] == "bounced"
    text = await _text(p.settings, "deliveries", "show", str(event.delivery_id))
    assert f"event            {event.event_id} console.test order-2" in text
