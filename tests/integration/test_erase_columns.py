"""Erasure, what it covers: the table-by-table list against a migrated database (a new text
or jsonb column fails until someone decides what an erasure does to it), the mention
pattern as PostgreSQL reads it, and the other kinds of recipient end to end: a phone number
(its suppression and receipts, through the local SMS provider) and a webhook URL (its
registry row, own secrets, subscriptions and disable/enable records)."""

from __future__ import annotations

import re
from urllib.parse import quote

import asyncpg
import pytest

from service import db, erasure_columns, erasure_recipient, outbox
from service.settings import Settings
from tests.support import erasure as es
from tests.support import relay as rs
from tests.support.erasure import echo
from tests.support.providers import providers

__all__ = ["echo"]  # fixtures

pytestmark = pytest.mark.timeout(240)

ANN_PHONE, BOB_PHONE = "+14155550000", "+14155559876"


# ------------------------------------------------------------------------- the list


async def test_every_text_and_jsonb_column_is_listed_with_what_erase_does_to_it(
    pool: asyncpg.Pool,
) -> None:
    """A new column fails here until someone decides (in service/erasure_columns.py)
    whether it can hold a recipient and what an erasure does to it."""
    rows = await pool.fetch(
        "SELECT c.table_name, c.column_name FROM information_schema.columns AS c"
        " JOIN information_schema.tables AS t USING (table_schema, table_name)"
        " WHERE c.table_schema = 'public' AND t.table_type = 'BASE TABLE'"
        " AND c.data_type IN ('text', 'character varying', 'character', 'jsonb', 'json')"
    )
    in_database = {(r["table_name"], r["column_name"]) for r in rows}
    listed = {(c.table, c.column) for c in erasure_columns.COLUMNS}
    assert sorted(in_database - listed) == []
    assert sorted(listed - in_database) == []
    # Each statement that changes a table is listed for it, and only those.
    acting = {c.table for c in erasure_columns.COLUMNS if c.action != erasure_columns.Action.NONE}
    blocks = [n for n in db.queries() if n.startswith("erase_") and n not in _READS]
    assert {_table_of(db.q(n)) for n in blocks} == acting


@pytest.mark.parametrize(
    ("recipient", "text", "mentions"),
    [
        ("ann@example.com", "Write to ANN@example.com.", True),
        ("ann@example.com", "joann@example.com", False),
        ("ann@example.com", "q=ann%40example.com&x", True),
        ("+14155550123", "+141555501234", False),
        ("https://p.example/h", "see https://p.example/h/2", False),
    ],
)
async def test_postgresql_reads_the_mention_pattern_as_python_does(
    pool: asyncpg.Pool, recipient: str, text: str, mentions: bool
) -> None:
    who = erasure_recipient.parse(recipient)
    pattern = erasure_recipient.mention_pattern(who, [])
    assert await pool.fetchval("SELECT $2::text ~* $1", pattern, text) is mentions
    assert bool(re.search(pattern, text, re.IGNORECASE)) is mentions


_READS = {"erase_spellings", "erase_reminders_of", "erase_in_flight", "erase_left_unerased",
          "erase_no_deadline"}  # fmt: skip


def _table_of(sql: str) -> str:
    """The table a statement changes (UPDATE t / DELETE FROM t)."""
    match = re.search(r"\b(?:UPDATE|DELETE FROM) (\w+)", sql)
    assert match is not None, sql
    return match.group(1)


# ----------------------------------------------------------------------------- SMS, URL


async def test_erasing_a_phone_number_written_any_way_removes_its_suppression_and_receipts(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    async with providers(settings) as p:
        # The local provider answers a number ending 0000 "undelivered" (30005, permanent):
        # its receipt suppresses the number, through relay receipts.
        await rs.load(
            pool,
            [
                rs.line("ann-sms", ANN_PHONE, channel="sms", payload={"body": "Hi"}),
                rs.line("bob-sms", BOB_PHONE, channel="sms", payload={"body": f"Bob {BOB_PHONE}"}),
            ],
        )
        await es.intent(pool, "text:1:sms", "sms", ANN_PHONE, body=f"Call back on {ANN_PHONE}")
        await es.ok(p.settings, "publish")
        async with rs.consumer_in_process(p.settings):
            settled = "SELECT count(*) FROM deliveries WHERE state IN ('delivered', 'bounced')"
            await es.until(pool, settled, 3, "three texts settled")
            await p.sms.wait_idle()
        needles = [ANN_PHONE, quote(ANN_PHONE, safe="")]
        assert set(await es.hits(pool, needles)) == {
            "reminders.destination", "deliveries.destination", "deliveries.payload",
            "suppressions.address",
        }  # fmt: skip
        before = await es.dump(pool)
        done = await es.erase(p.settings, "--recipient", "+1 (415) 555-0000", "--reason", "R",
                            "--apply")  # fmt: skip
        counts = done["counts"]
        assert (counts["deliveries"], counts["suppressions"]) == ({"erased": 2}, {"deleted": 1})
        assert counts["receipts"]["deleted"] >= 2  # each text's callbacks
        assert await es.hits(pool, needles) == {}
        assert es.holding(await es.dump(pool), BOB_PHONE) == es.holding(before, BOB_PHONE)


async def test_erasing_a_webhook_url_removes_its_destination_secrets_and_subscriptions(
    settings: Settings, pool: asyncpg.Pool, echo: str
) -> None:
    s = es.keyed(settings)
    ann_url, bob_url = echo.replace("partner", "ann"), echo.replace("partner", "bob")
    await es.ok(s, "event-types", "add", "customer.updated")
    for url in (ann_url, bob_url):
        await es.ok(s, "destinations", "add", url)
        await es.ok(s, "destinations", "subscribe", url, "customer.updated")
        await es.ok(s, "destinations", "disable", url, "--reason", "maintenance")
        await es.ok(s, "destinations", "enable", url, "--reason", "back", "--apply")
    await rs.load(pool, [rs.line("ann-hook", ann_url), rs.line("bob-hook", bob_url)])
    async with pool.acquire() as conn, conn.transaction():
        await outbox.add_event(conn, key="c:1", event_type="customer.updated", payload={"n": 1})
    await es.ok(s, "publish")
    async with rs.consumer_in_process(s):
        await es.until(pool, "SELECT count(*) FROM deliveries WHERE state = 'delivered'", 4,
                     "four deliveries delivered")  # fmt: skip
    ann_tail = ann_url.removeprefix("http://")  # any scheme's case
    before = await es.dump(pool)
    done = await es.erase(s, "--recipient", ann_url.replace("http://", "HTTP://"), "--reason", "R",
                        "--apply")  # fmt: skip
    counts = done["counts"]
    assert counts["deliveries"] == {"erased": 2}  # its reminder's and its event's
    for table in ("destinations", "event_subscriptions", "destination_actions"):
        assert counts[table]["deleted"] >= 1, table
    assert counts["destination_secrets"] == {"deleted": 1}
    assert await es.hits(pool, [ann_tail]) == {}
    assert es.holding(await es.dump(pool), bob_url) == es.holding(before, bob_url)
    assert await pool.fetchval("SELECT count(*) FROM destinations") == 1
