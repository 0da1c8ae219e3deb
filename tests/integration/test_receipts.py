"""Provider receipts end to end: the local e-mail and SMS providers accept a message, then
post signed status callbacks over HTTP to `relay receipts`, which verifies them and moves
the ledger: accepted -> delivered or bounced, the run report counting each apart."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from service import ledger
from service.ledger import State, control, sending
from service.settings import Settings
from tests.support import relay as rs
from tests.support.providers import providers


def _email(reminder_id: str, address: str) -> str:
    payload = {"subject": f"Report {reminder_id}", "text": "Your daily report"}
    return rs.line(reminder_id, address, channel="email", payload=payload)


def _sms(reminder_id: str, number: str) -> str:
    return rs.line(reminder_id, number, channel="sms", payload={"body": f"Hi {reminder_id}"})


async def _by_reminder(pool: asyncpg.Pool) -> dict[str, str]:
    rows = await pool.fetch("SELECT reminder_id, state::text AS state FROM deliveries")
    return {r["reminder_id"]: r["state"] for r in rows}


async def _settled(pool: asyncpg.Pool, expected: dict[str, str]) -> None:
    async def done() -> bool:
        return await _by_reminder(pool) == expected

    await rs.wait_for(done, 60, f"deliveries settled as {expected}")


async def _status(settings: Settings, *args: str) -> Any:
    result = await rs.relay(settings, "status", "--json", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


async def test_email_receipts_say_delivered_or_bounced_and_the_report_counts_them_apart(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    async with providers(settings, delay_seconds=0.2) as p:
        await rs.load(
            pool,
            [
                _email("ok", "ann@example.com"),
                _email("hard", "bounce-bob@example.com"),
                _email("soft", "softbounce-cy@example.com"),
                _email("late", "slow-dee@example.com"),
                _email("spam", "complain-eve@example.com"),
            ],
        )
        assert (await rs.relay(p.settings, "publish")).code == 0
        async with rs.consumer_in_process(p.settings):
            await _settled(
                pool,
                {
                    "ok": "delivered",
                    "hard": "bounced",
                    "soft": "bounced",
                    "late": "delivered",
                    "spam": "delivered",
                },
            )
    # The provider's message id is on the attempt; every callback is one receipt row.
    attempts = await pool.fetch(
        "SELECT a.provider_message_id, d.reminder_id FROM delivery_attempts a"
        " JOIN deliveries d ON d.id = a.delivery_id"
    )
    assert {a["provider_message_id"] for a in attempts} == {e["id"] for e in p.email.emails}
    outcomes = await pool.fetch(
        "SELECT d.reminder_id, array_agg(r.outcome ORDER BY r.id) AS o FROM receipts r"
        " JOIN deliveries d ON d.id = r.delivery_id GROUP BY 1"
    )
    assert {r["reminder_id"]: r["o"] for r in outcomes} == {
        "ok": ["sent", "delivered"],
        "hard": ["sent", "bounced"],
        "soft": ["sent", "bounced"],
        "late": ["sent", "delayed", "delivered"],
        "spam": ["sent", "delivered", "complained"],
    }
    assert all(status == 200 for _, status in p.email.callbacks), p.email.callbacks
    report = await _status(p.settings)
    email = report["runs"][0]["by_channel"]["email"]
    assert (email["owed"], email["delivered"], email["bounced"], email["accepted"]) == (5, 3, 2, 0)
    assert report["runs"][0]["completion_ratio"] == 0.6
    missing = await _status(p.settings, "--missing")
    assert sorted((m["reminder_id"], m["state"]) for m in missing["missing"]) == [
        ("hard", "bounced"),
        ("soft", "bounced"),
    ]
    assert {m["last_error"] for m in missing["missing"]} == {
        "bounced: Permanent/General",
        "bounced: Transient/MailboxFull",
    }


async def test_sms_status_callbacks_settle_deliveries_and_are_verified_by_twilios_scheme(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    async with providers(settings, delay_seconds=0.1) as p:
        await rs.load(
            pool,
            [
                _sms("ok", "+14155550123"),
                _sms("gone", "+14155550000"),
                _sms("flaky", "+14155551111"),
            ],
        )
        assert (await rs.relay(p.settings, "publish")).code == 0
        async with rs.consumer_in_process(p.settings):
            await _settled(pool, {"ok": "delivered", "gone": "bounced", "flaky": "bounced"})
    # Each message asked for its callbacks at relay receipts, naming its delivery.
    deliveries = {r["reminder_id"]: r["id"] for r in await pool.fetch("SELECT * FROM deliveries")}
    assert {m["callback"] for m in p.sms.messages} == {
        f"{p.receipts_url}/receipts/sms?delivery={deliveries[name]}"
        for name in ("ok", "gone", "flaky")
    }
    assert [s for s, answer in p.sms.callbacks if answer != 200] == []
    reasons = await pool.fetch(
        "SELECT d.reminder_id, r.reason, r.permanent FROM receipts r"
        " JOIN deliveries d ON d.id = r.delivery_id WHERE r.outcome = 'bounced'"
    )
    assert {(r["reminder_id"], r["reason"], r["permanent"]) for r in reasons} == {
        ("gone", "30005", True),
        ("flaky", "30008", False),
    }
    report = await _status(p.settings)
    sms = report["runs"][0]["by_channel"]["sms"]
    assert (sms["delivered"], sms["bounced"], sms["accepted"], sms["no_receipt"]) == (1, 2, 0, 0)


async def test_accepted_without_a_receipt_is_reported_as_no_receipt_after_the_wait(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    async with providers(settings) as p:
        p.email.webhook_url = None  # this provider sends no receipts
        await rs.load(pool, [_email("quiet", "ann@example.com")])
        assert (await rs.relay(p.settings, "publish")).code == 0
        async with rs.consumer_in_process(p.settings):
            await _settled(pool, {"quiet": "accepted"})
    waited = p.settings.model_copy(update={"receipt_wait_seconds": 1.0})

    async def overdue() -> bool:
        report = await _status(waited)
        return bool(report["runs"][0]["by_channel"]["email"]["no_receipt"] == 1)

    await rs.wait_for(overdue, 30, "the accepted e-mail counted as without a receipt")
    text = await rs.relay(waited, "status")
    assert "email: delivered 0/1 (0.0%), accepted 1 (no receipt after 1 s: 1), bounced 0" in (
        text.stdout
    )
    assert "accepted by a provider, no receipt yet: 1 (1 after 1 s)" in text.stdout
    missing = await rs.relay(waited, "status", "--missing")
    assert "accepted, no receipt after 1 s" in missing.stdout
    shown = await rs.relay(waited, "deliveries", "show", "1")
    assert "provider message: " + p.email.emails[0]["id"] in shown.stdout


async def test_an_email_on_the_wire_when_its_run_is_cancelled_ends_accepted_and_unmarked(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    """`relay runs cancel` marks a claimed e-mail past its last check (the claim) as on the
    wire; the provider's acceptance then stands: the row ends `accepted` (final for the
    consumer, a receipt still settles it), the operator's mark gone with the claim's stamp."""
    await rs.load(pool, [_email("wire", "ann@example.com")])
    assert (await rs.relay(settings, "publish")).code == 0
    delivery_id, run_id = await pool.fetchrow("SELECT id, run_id FROM deliveries")
    async with pool.acquire() as conn:
        claimed, _ = await sending.claim(conn, [delivery_id], 30.0)
        result = await control.act_on_run(
            conn, run_id, "cancel", operator="test", reason="wrong list", apply=True
        )
        assert result is not None and result.wire == ((delivery_id, 1),)
        record = ledger.Attempt(outcome="accepted", http_status=200, provider_message_id="em_1")
        written = await sending.complete(
            conn, [ledger.Completion(delivery_id, 1, State.ACCEPTED, record=record)]
        )
    assert delivery_id in claimed and written == {(delivery_id, 1)}
    row = await pool.fetchrow(
        "SELECT state::text, stop_action_id, last_check_at, finished_at FROM deliveries"
    )
    assert (row["state"], row["stop_action_id"], row["last_check_at"]) == ("accepted", None, None)
    assert row["finished_at"] is not None
