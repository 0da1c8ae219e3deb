"""Reconciliation's other answers: the provider has no such message (sent now, once), or
cannot say (SMS: held and asked again, no text sent meanwhile; e-mail: sent with the same
key). Each starts from a row a consumer claimed and lost before its request was answered."""

from __future__ import annotations

import asyncio
import json
import logging

import asyncpg
import pytest

from service.settings import Settings
from tests.support import relay as rs
from tests.support.providers import Providers, providers


async def _lost_claim(p: Providers, pool: asyncpg.Pool, line: str) -> int:
    """Load and publish ``line``, then leave its row as a consumer that claimed it and died
    would: sending, one attempt, the lease run out. Its id."""
    await rs.load(pool, [line])
    assert (await rs.relay(p.settings, "publish")).code == 0
    delivery_id = await pool.fetchval(
        "UPDATE deliveries SET state = 'sending', attempts = 1, first_attempt_at = now(),"
        " lease_expires_at = now() - interval '1 second' RETURNING id"
    )
    return int(delivery_id)


async def _reconciled(pool: asyncpg.Pool) -> list[tuple[int, list[int], str, str]]:
    rows = await pool.fetch(
        "SELECT attempt, checked_attempts, answer, policy FROM reconciliations ORDER BY id"
    )
    return [(r["attempt"], r["checked_attempts"], r["answer"], r["policy"]) for r in rows]


async def _until(pool: asyncpg.Pool, states: dict[str, int], what: str) -> None:
    async def reached() -> bool:
        return await rs.states(pool) == states

    await rs.wait_for(reached, 60, what)


async def test_a_lost_sms_the_provider_never_got_is_sent_once_after_asking(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    async with providers(settings) as p:
        line = rs.line("lost", "+14155550123", channel="sms", payload={"body": "hi"})
        await _lost_claim(p, pool, line)
        async with rs.consumer_in_process(p.settings):
            await _until(pool, {"delivered": 1}, "the SMS sent and delivered")
        assert len(p.sms.messages) == 1
    assert await _reconciled(pool) == [(2, [1], "not_found", "resend")]
    outcomes = await pool.fetch("SELECT attempt, outcome FROM delivery_attempts ORDER BY attempt")
    assert [(a["attempt"], a["outcome"]) for a in outcomes] == [(1, "lost"), (2, "accepted")]


async def test_an_sms_is_held_while_the_provider_cannot_say_and_sent_once_it_can(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    async with providers(settings.model_copy(update={"reconcile_hold_seconds": 1.0})) as p:
        p.sms.list_fails = True
        line = rs.line("unsure", "+14155550123", channel="sms", payload={"body": "hi"})
        delivery_id = await _lost_claim(p, pool, line)
        async with rs.consumer_in_process(p.settings):

            async def asked_twice() -> bool:
                return len(await _reconciled(pool)) >= 2

            await rs.wait_for(asked_twice, 60, "the provider asked twice, unanswered")
            assert p.sms.messages == []  # held: nothing sent while the provider cannot say
            row = await pool.fetchrow("SELECT state::text, attempts FROM deliveries")
            assert row is not None and row["attempts"] <= 2  # no attempt counted for a hold
            p.sms.list_fails = False
            await _until(pool, {"delivered": 1}, "the SMS sent once the provider answered")
        assert len(p.sms.messages) == 1
        shown = await rs.relay(p.settings, "deliveries", "show", str(delivery_id))
    asked = await _reconciled(pool)
    assert {a[2:] for a in asked[:-1]} == {("unknown", "hold")}
    assert asked[-1][2:] == ("not_found", "resend")
    assert all(a[:2] == (2, [1]) for a in asked)  # every hold gave the claim back
    assert "unknown (http 500); held, to ask again (policy for SMS" in shown.stdout


async def test_an_email_is_sent_with_the_same_key_when_the_provider_cannot_say(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    async with providers(settings) as p:
        p.email.list_fails = True
        payload = {"subject": "Report", "text": "Your report"}
        await _lost_claim(
            p, pool, rs.line("unsure", "ann@example.com", channel="email", payload=payload)
        )
        async with rs.consumer_in_process(p.settings):
            await _until(pool, {"delivered": 1}, "the e-mail sent with its key and delivered")
        assert list(p.email.requests.values()) == [1]
    assert await _reconciled(pool) == [(2, [1], "unknown", "resend_same_key")]


async def test_a_cancel_while_the_provider_is_asked_moves_the_row_and_nothing_is_sent(
    settings: Settings, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """Asking the provider is a wait: the claim's stamp is taken back first, so `relay runs
    cancel` meanwhile moves the claimed row (not "on the wire"), and when the provider then
    says it has no such message, the send's last check finds the row cancelled: no text."""
    caplog.set_level(logging.INFO, logger="relay.consumer")
    slow = settings.model_copy(update={"http_timeout_seconds": 20.0, "lease_seconds": 60.0})
    async with providers(slow) as p:
        p.sms.list_gate = asyncio.Event()  # the provider's list answers when the test says
        line = rs.line("asked", "+14155550123", channel="sms", payload={"body": "hi"})
        delivery_id = await _lost_claim(p, pool, line)
        run_id = await pool.fetchval("SELECT run_id FROM deliveries WHERE id = $1", delivery_id)
        async with rs.consumer_in_process(p.settings):

            async def asking() -> bool:
                return p.sms.lists == 1

            await rs.wait_for(asking, 60, "the consumer asking the provider about attempt 1")
            row = await pool.fetchrow("SELECT state::text, attempts, last_check_at FROM deliveries")
            assert (row["state"], row["attempts"], row["last_check_at"]) == ("sending", 2, None)
            cancel = await rs.relay(
                p.settings,
                "runs",
                "cancel",
                str(run_id),
                "--apply",
                "--json",
                "--no-wait",
                "--reason",
                "wrong list",
            )
            assert cancel.code == 0, cancel.stderr
            result = json.loads(cancel.stdout)
            assert (result["claimed_stopped"], result["on_the_wire"]) == (1, 0)
            p.sms.list_gate.set()

            async def settled() -> bool:
                stopped = any(getattr(r, "event", "") == "stopped" for r in caplog.records)
                return stopped or bool(p.sms.messages)

            await rs.wait_for(settled, 60, "the consumer's last check after the answer")
        assert p.sms.messages == []
    assert await _reconciled(pool) == [(2, [1], "not_found", "resend")]
    row = await pool.fetchrow("SELECT state::text, skip_reason FROM deliveries")
    assert (row["state"], row["skip_reason"]) == ("skipped", "cancelled")
