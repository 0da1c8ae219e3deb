"""The seed's drill: the provider accepts, the worker is SIGKILLed before the outcome write
(crash point ``after_send``), a new worker takes the row. It asks the provider before
sending again, finds the message, sends nothing, and the row ends ``delivered`` (by the
receipts the provider sent meanwhile) with the reconciliation recorded: exactly one
message at the provider."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import asyncpg
import pytest

from service.settings import Settings
from tests.support import relay as rs
from tests.support.providers import Providers, providers

pytestmark = pytest.mark.fault


async def _drill(p: Providers, pool: asyncpg.Pool, line: str, log: Path) -> asyncpg.Record:
    """Load and publish ``line``; a consumer killed right after the provider's 2xx; a
    clean one after it. The row once it is delivered."""
    await rs.load(pool, [line])
    assert (await rs.relay(p.settings, "publish")).code == 0
    crashing = await rs.start_consumer(p.settings, CRASH_AT="after_send")
    assert await asyncio.wait_for(crashing.wait(), 60) == -signal.SIGKILL
    await p.email.wait_idle()
    await p.sms.wait_idle()
    # The provider has the message and told relay receipts so; the ledger still says the
    # row is being sent, by a consumer that is gone.
    row = await pool.fetchrow("SELECT state::text AS state, attempts FROM deliveries")
    assert row is not None and (row["state"], row["attempts"]) == ("sending", 1)
    assert await pool.fetchval("SELECT count(*) FROM receipts WHERE outcome = 'delivered'") == 1
    recovered = await rs.start_consumer(p.settings, log_path=log)
    try:

        async def delivered() -> bool:
            return await rs.states(pool) == {"delivered": 1}

        # The redelivered message waits for the dead consumer's lease (3 s) to expire.
        await rs.wait_for(delivered, 60, "the row delivered after the crash")
    finally:
        assert await rs.stop(recovered) == 0
    final = await pool.fetchrow("SELECT * FROM deliveries")
    assert final is not None
    return final


async def _story(pool: asyncpg.Pool, delivery_id: int) -> tuple[list[tuple[int, str]], list[str]]:
    attempts = await pool.fetch(
        "SELECT attempt, outcome, provider_message_id FROM delivery_attempts"
        " WHERE delivery_id = $1 ORDER BY attempt",
        delivery_id,
    )
    ids = [a["provider_message_id"] for a in attempts if a["provider_message_id"]]
    return [(a["attempt"], a["outcome"]) for a in attempts], ids


async def test_sms_accepted_then_worker_killed_is_reconciled_with_twilio_and_never_resent(
    settings: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    async with providers(settings) as p:
        line = rs.line("drill", "+14155550123", channel="sms", payload={"body": "Hold expires"})
        row = await _drill(p, pool, line, tmp_path / "consumer.log")
        assert len(p.sms.messages) == 1  # exactly one message at the provider
        sid = p.sms.messages[0]["sid"]
        shown = await rs.relay(p.settings, "deliveries", "show", str(row["id"]))
    assert row["attempts"] == 2 and row["settled_at"] is not None
    assert await _story(pool, row["id"]) == ([(1, "lost"), (2, "reconciled")], [sid])
    found = await pool.fetch("SELECT * FROM reconciliations")
    assert [
        (r["attempt"], r["checked_attempts"], r["answer"], r["provider_message_id"], r["policy"])
        for r in found
    ] == [(2, [1], "found", sid, "no_resend")]
    assert await rs.logged(tmp_path / "consumer.log", "reconciled")
    assert "attempt #2 asked about #1: found (message " + sid in shown.stdout
    assert "not sent again" in shown.stdout


async def test_email_accepted_then_worker_killed_is_found_by_the_list_not_sent_again(
    settings: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    async with providers(settings) as p:
        payload = {"subject": "Your hold expired", "text": "Hold 7 expired."}
        line = rs.line("drill", "ann@example.com", channel="email", payload=payload)
        row = await _drill(p, pool, line, tmp_path / "consumer.log")
        # One POST only: the second worker asked (GET /emails) instead of posting again.
        assert list(p.email.requests.values()) == [1] and len(p.email.emails) == 1
        email_id = p.email.emails[0]["id"]
    assert await _story(pool, row["id"]) == ([(1, "lost"), (2, "reconciled")], [email_id])
    found = await pool.fetchrow("SELECT answer, provider_message_id, policy FROM reconciliations")
    assert found is not None and tuple(found) == ("found", email_id, "no_resend")
