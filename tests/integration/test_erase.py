"""Erasure by recipient (`relay erase`), against real PostgreSQL, RabbitMQ and HTTP servers:
an e-mail address's data is seeded through the product's own paths (a reminders file, the
outbox, an event, publish and consume to the local e-mail provider and a real partner, the
provider's receipts, an operator's suppression, run and destination actions, a console
reveal), beside another recipient's; then every text, varchar and jsonb column of every
table and view is searched for every spelling of the address: none is left, the other
recipient's rows are as they were, a dry run changes nothing and counts what the apply
changes, a delivery in flight refuses it, and the audit row holds a keyed hash only."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import asyncpg
import pytest

from service import outbox
from service.ledger import sending
from service.ops.console import data as console_data
from service.ops.console import refs
from service.settings import Settings
from tests.support import erasure as es
from tests.support import relay as rs
from tests.support.erasure import echo
from tests.support.providers import Providers, providers

__all__ = ["echo"]  # fixtures

pytestmark = pytest.mark.timeout(240)

ANN = "ann.lee@example.com"
ANN_STORED = "Ann.Lee@Example.COM"  # how the reminders file wrote it
BOB = "bob.ray@example.com"


# ---------------------------------------------------------------------- e-mail, end to end


async def _seed_email(p: Providers, s: Settings, pool: asyncpg.Pool, partner: str) -> None:
    """Ann's and Bob's data, through the product's paths, until every send is settled."""
    await es.ok(s, "event-types", "add", "customer.updated", "--description", f"e.g. {ANN}")
    await es.ok(s, "destinations", "add", partner)
    await es.ok(s, "destinations", "subscribe", partner, "customer.updated")
    await es.ok(
        s, "destinations", "subscribe", partner, "customer.*", "--filter", f"customer={ANN}"
    )
    await rs.load(
        pool,
        [
            es.email("ann-report", ANN_STORED, f"Reply to {ANN} to change it"),
            es.email("bob-report", BOB, f"Reply to {BOB} to change it"),
        ],
    )
    await es.intent(pool, "order:1:email", "email", ANN, subject="Order", text="Yours, Ann")
    await es.intent(pool, "order:2:email", "email", BOB, subject="Order", text="Yours, Bob")
    async with pool.acquire() as conn, conn.transaction():
        await outbox.add_event(conn, key="cust:1", event_type="customer.updated",
                               payload={"customer": ANN, "name": "Ann"})  # fmt: skip
        await outbox.add_event(conn, key="cust:2", event_type="customer.updated",
                               payload={"customer": BOB, "name": "Bob"})  # fmt: skip
    await es.ok(s, "publish")
    async with rs.consumer_in_process(s):
        await es.until(pool, "SELECT count(*) FROM deliveries WHERE state = 'delivered'", 6,
                     "six deliveries delivered (receipts in)")  # fmt: skip
        await p.email.wait_idle()


async def _operators_words(s: Settings, pool: asyncpg.Pool, partner: str) -> None:
    """What operators wrote about Ann (and Bob), through their commands."""
    await es.ok(s, "suppressions", "add", "email", ANN_STORED, "--reason", f"{ANN} asked to stop")
    await es.ok(s, "suppressions", "add", "email", BOB, "--reason", f"{BOB} asked to stop")
    run = await pool.fetchval("SELECT max(id) FROM publish_runs WHERE kind = 'publish'")
    for action in ("hold", "release"):
        await es.ok(s, "runs", action, str(run), "--reason", f"check {ANN} first", "--apply")
    await es.ok(s, "destinations", "disable", partner, "--reason", f"partner asked about {ANN}")
    await es.ok(s, "destinations", "enable", partner, "--reason", "partner back", "--apply")
    await console_data.record_reveal(pool, "alice", f"/events?q={quote(ANN)}", datetime.now(UTC))
    # A run's error text has no operator path that writes an address: set here.
    await pool.execute("UPDATE publish_runs SET error = $1 WHERE id = $2", f"x {ANN} y", run)


async def test_erasing_an_email_address_leaves_no_trace_in_any_column_and_bob_untouched(
    settings: Settings, pool: asyncpg.Pool, echo: str
) -> None:
    async with providers(settings) as p:
        s = es.keyed(p.settings)
        await _seed_email(p, s, pool, echo)
        await _operators_words(s, pool, echo)
        # Not sent yet when the erasure comes: queued, no consumer running.
        await es.intent(pool, "order:3:email", "email", ANN, subject="Later", text="Later")
        await es.ok(s, "publish")
        needles = [ANN, ANN_STORED, quote(ANN, safe="")]
        assert set(await es.hits(pool, needles)) >= {
            "reminders.destination", "reminders.payload", "deliveries.destination",
            "deliveries.payload", "delivery_attempts.response_excerpt", "events.payload",
            "suppressions.address", "suppressions.detail", "run_actions.reason",
            "destination_actions.reason", "event_subscriptions.filter",
            "event_types.description", "console_reveals.page", "publish_runs.error",
        }  # fmt: skip
        key = await refs.load(pool)
        before = await es.dump(pool)
        dry = await es.erase(s, "--recipient", ANN_STORED)
        assert await es.dump(pool) == before  # a dry run changes nothing
        done = await es.erase(s, "--recipient", " ann.lee@EXAMPLE.com ", "--reason", "DSAR-7",
                            "--apply")  # fmt: skip
        assert (done["applied"], dry["applied"]) == (True, False)
        assert done["counts"] == dry["counts"]
        assert await es.hits(pool, needles) == {}
        after = await es.dump(pool)
        assert es.holding(after, BOB) == es.holding(before, BOB)
        await _check_email_erasure(pool, done, key.of(ANN))
        await _shown_erased(s, pool)
        emailed = len(p.email.emails)
        await _not_revived(s, pool, p)
        assert [e["to"] for e in p.email.emails[emailed:]] == [["cy@example.com"]]
        assert await es.hits(pool, needles) == {}


async def _check_email_erasure(pool: asyncpg.Pool, done: dict[str, Any], ref: str) -> None:
    counts = done["counts"]
    # Her report, her two intents (one not sent yet); the partner's copy of her event is
    # the partner's delivery: only the mention in its payload goes.
    assert counts["deliveries"] == {"erased": 3, "skipped": 1, "mentions scrubbed": 1}
    assert counts["reminders"] == {"erased": 1}
    assert counts["receipts"]["deleted"] >= 4  # sent + delivered for each e-mail
    assert counts["suppressions"] == {"deleted": 1}
    for table in ("events", "event_types", "event_subscriptions", "destination_actions",
                  "console_reveals", "publish_runs"):  # fmt: skip
        assert counts[table] == {"mentions scrubbed": 1}, table
    assert counts["run_actions"] == {"mentions scrubbed": 2}  # hold and release
    mine = await pool.fetch(
        "SELECT state::text AS state, skip_reason, erased_at IS NOT NULL AS erased"
        " FROM deliveries WHERE erased_at IS NOT NULL ORDER BY id"
    )
    assert [(r["state"], r["skip_reason"]) for r in mine] == [
        ("delivered", None), ("delivered", None), ("skipped", "erased")
    ]  # fmt: skip
    ann = await pool.fetchrow("SELECT * FROM reminders WHERE id = 'ann-report'")
    assert (ann["destination"], ann["payload"], ann["active"], ann["inactive_reason"]) == (
        "erased",
        {},
        False,
        "erased",
    )
    audit = await pool.fetchrow("SELECT * FROM erasures")
    assert (audit["recipient_ref"], audit["channel"], audit["operator"], audit["reason"]) == (
        ref,
        "email",
        "alice",
        "DSAR-7",
    )
    assert audit["counts"] == counts and done["recipient_ref"] == ref
    # Bob's suppression and receipts are still there.
    assert await pool.fetchval("SELECT count(*) FROM suppressions") == 1
    kept = "SELECT count(*) FROM receipts r JOIN deliveries d ON d.id = r.delivery_id"
    assert await pool.fetchval(kept + " WHERE d.erased_at IS NULL") >= 4


async def _shown_erased(s: Settings, pool: asyncpg.Pool) -> None:
    """``deliveries show`` says when an erased row was erased, and nothing of Ann."""
    erased = await pool.fetchval("SELECT min(id) FROM deliveries WHERE erased_at IS NOT NULL")
    text = await es.ok(s, "deliveries", "show", str(erased))
    assert "\n  erased           " in text and "(relay erase): recipient, payload" in text
    assert ANN not in text.lower() and ANN_STORED not in text
    shown = json.loads(await es.ok(s, "deliveries", "show", str(erased), "--json"))
    assert shown["erased_at"] is not None


async def _not_revived(s: Settings, pool: asyncpg.Pool, p: Providers) -> None:
    """The same file loaded again does not bring Ann back, nor do cancel or backfill; a
    consumer takes her queued message, finds the row erased and sends nothing; a
    dead-letter replay never reopens her rows."""
    file = Path(s.state_dir) / "again.jsonl"  # type: ignore[arg-type]
    again = [es.email("ann-report", ANN_STORED, "again"), es.email("cy", "cy@example.com", "hi")]
    file.write_text("\n".join(again) + "\n")
    out = await es.ok(s, "reminders", "load", str(file))
    assert "1 lines name erased reminders (relay erase): not loaded" in out, out
    assert (await rs.relay(s, "reminders", "cancel", "ann-report")).code == 1
    since = (datetime.now(UTC) - timedelta(days=1)).isoformat()
    backfill = await rs.relay(s, "backfill", "--reminder", "ann-report", "--from", since)
    assert backfill.code == 2 and "no reminder" in backfill.stderr
    ann = "SELECT destination || inactive_reason FROM reminders WHERE id = 'ann-report'"
    assert await pool.fetchval(ann) == "erasederased"
    await es.ok(s, "publish")
    async with rs.consumer_in_process(s) as consumer:

        async def settled() -> bool:
            taken = consumer.metric("relay.delivery.duplicates", state="skipped") == 1
            cy = "SELECT state::text FROM deliveries WHERE reminder_id = 'cy'"
            return taken and await pool.fetchval(cy) in ("accepted", "delivered")

        await rs.wait_for(settled, 60, "Ann's message taken (erased), Cy's sent")
        await p.email.wait_idle()
    # As if her queued delivery had died before the erasure: a replay leaves it dead.
    await pool.execute(
        "UPDATE deliveries SET state = 'dead', skip_reason = NULL, dead_lettered_at = now()"
        " WHERE skip_reason = 'erased'"
    )
    await es.ok(s, "replay", "--from", "ledger", "--apply")
    dead = "SELECT count(*) FROM deliveries WHERE erased_at IS NOT NULL AND state = 'dead'"
    assert await pool.fetchval(dead) == 1


# ------------------------------------------------------------------------------ refusal


async def test_a_delivery_in_flight_refuses_the_erasure_and_nothing_changes(
    settings: Settings, pool: asyncpg.Pool, echo: str
) -> None:
    url = echo.replace("partner", "ann")
    await rs.load(pool, [rs.line("ann-hook", url), rs.line("ann-later", url, due_at=None)])
    await es.ok(settings, "publish")  # queued: no consumer runs
    ids = [r["id"] for r in await pool.fetch("SELECT id FROM deliveries ORDER BY id")]
    async with pool.acquire() as conn:
        claimed, _ = await sending.claim(conn, ids[:1], lease_seconds=60)
    assert list(claimed) == ids[:1]
    await refs.load(pool)  # the deployment's key exists (the first console or erase makes it)
    before = await es.dump(pool)
    refused = await es.erase(settings, "--recipient", url, "--reason", "R", "--apply", code=4)
    (line,) = refused["stderr"].splitlines()
    assert f"1 of this recipient's deliveries in flight: {ids[0]} (sending)" in line
    assert "nothing changed" in line and "hooks/ann" not in line
    dry = await es.erase(settings, "--recipient", url, code=4)  # the dry run says so too
    assert "in flight" in dry["stderr"]
    assert await es.dump(pool) == before
    # Its claim ends without a request: the erasure goes through, and the consumer that
    # takes the messages finds the rows erased and sends nothing.
    assert await sending.release(pool, ids[0], claimed[ids[0]].attempts, None)
    done = await es.erase(settings, "--recipient", url, "--reason", "R", "--apply")
    assert done["counts"]["deliveries"] == {"erased": 2, "skipped": 2}
    async with rs.consumer_in_process(settings) as consumer:

        async def both_taken() -> bool:
            return consumer.metric("relay.delivery.duplicates", state="skipped") == 2

        await rs.wait_for(both_taken, 60, "both messages taken and found erased")
    assert await pool.fetchval("SELECT count(*) FROM delivery_attempts") == 0
