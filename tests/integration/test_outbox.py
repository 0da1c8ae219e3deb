"""The outbox API against real PostgreSQL, RabbitMQ and HTTP on 127.0.0.1: an intent
commits or rolls back with the caller's transaction, and a committed one is relayed by
``relay publish`` and delivered once."""

from __future__ import annotations

import json

import asyncpg
import pytest

from service import outbox
from service.settings import Settings
from tests.support import relay as rs
from tests.support.relay import RunningPartner

pytestmark = pytest.mark.timeout(60)


_EMAIL = {"subject": "s", "text": "t"}


def _nested(depth: int) -> dict[str, object]:
    payload: dict[str, object] = {}
    for _ in range(depth):
        payload = {"a": payload}
    return payload


async def _one(pool: asyncpg.Pool, sql: str, *args: object) -> asyncpg.Record:
    row = await pool.fetchrow(sql, *args)
    assert row is not None, sql
    return row


async def _count(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM deliveries"))


async def test_add_intent_outside_a_transaction_raises_and_writes_nothing(
    pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    async with pool.acquire() as conn:
        with pytest.raises(outbox.NoTransactionError, match="open transaction"):
            await outbox.add_intent(
                conn,
                key="order:1:paid:webhook",
                channel="webhook",
                destination=partner.url(),
                allow_networks=rs.LOOPBACK,
                payload={"order": 1},
            )
    assert await _count(pool) == 0


async def test_intent_in_a_rolled_back_transaction_leaves_nothing(
    pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    class Abort(Exception):
        pass

    async with pool.acquire() as conn:
        with pytest.raises(Abort):
            async with conn.transaction():
                new_id = await outbox.add_intent(
                    conn,
                    key="order:1:paid:webhook",
                    channel="webhook",
                    destination=partner.url(),
                    allow_networks=rs.LOOPBACK,
                    payload={"order": 1},
                )
                assert new_id is not None
                raise Abort
    assert await _count(pool) == 0


async def test_committed_intent_is_a_pending_outbox_row_with_its_own_destination_and_payload(
    pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    async with pool.acquire() as conn, conn.transaction():
        new_id = await outbox.add_intent(
            conn,
            key="order:1:paid:webhook",
            channel="webhook",
            destination=partner.url("orders"),
            allow_networks=rs.LOOPBACK,
            payload={"order": 1, "event": "paid"},
            urgent=True,
        )
    row = await _one(pool, "SELECT * FROM deliveries")
    assert row is not None and row["id"] == new_id
    assert (row["state"], row["source"], row["idempotency_key"]) == (
        "pending",
        "outbox",
        "outbox:order:1:paid:webhook",
    )
    assert row["reminder_id"] is None and row["run_id"] is None
    assert (row["channel"], row["provider"], row["urgent"]) == ("webhook", "webhook", True)
    assert row["destination"] == partner.url("orders")
    assert row["payload"] == {"order": 1, "event": "paid"}


async def test_same_key_twice_adds_one_intent_and_the_first_one_stands(
    pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    ids = []
    for attempt in (1, 2):  # e.g. the application's transaction retried as a whole
        async with pool.acquire() as conn, conn.transaction():
            ids.append(
                await outbox.add_intent(
                    conn,
                    key="order:1:paid:webhook",
                    channel="webhook",
                    destination=partner.url(),
                    allow_networks=rs.LOOPBACK,
                    payload={"attempt": attempt},
                )
            )
    # Twice within one transaction, too.
    async with pool.acquire() as conn, conn.transaction():
        for _ in range(2):
            ids.append(
                await outbox.add_intent(
                    conn,
                    key="order:1:paid:webhook",
                    channel="webhook",
                    destination=partner.url(),
                    allow_networks=rs.LOOPBACK,
                    payload={"attempt": 3},
                )
            )
    assert ids[0] is not None and ids[1:] == [None, None, None]
    rows = await pool.fetch("SELECT id, payload FROM deliveries")
    assert [(r["id"], r["payload"]) for r in rows] == [(ids[0], {"attempt": 1})]


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"channel": "fax"}, "channel: must be one of"),
        ({"destination": "ftp://partner.example/x"}, "scheme must be http or https"),
        ({"destination": "https://user:pw@partner.example/x"}, "userinfo"),
        ({"destination": "http://10.1.2.3/hooks"}, "destination: ssrf: private address"),
        ({"destination": "http://localhost:9/hooks"}, "destination: ssrf: loopback address"),
        ({"channel": "email", "destination": ""}, "non-empty"),
        ({"channel": "sms", "destination": "   "}, "non-empty"),
        (
            {"channel": "email", "destination": "not-an-email-address", "payload": _EMAIL},
            "destination: not a valid e-mail address",
        ),
        (
            {"channel": "sms", "destination": "555-1234", "payload": {"body": "b"}},
            "destination: not an E.164 phone number",
        ),
        ({"key": ""}, "key: must be a non-empty string"),
        ({"key": "has space"}, "key: use 1 to 249 characters"),
        ({"key": "café:1"}, "key: use 1 to 249 characters"),
        ({"key": "k" * 250}, "key: use 1 to 249 characters"),
        ({"provider": "a b"}, "provider: use 1 to 100 characters"),
        ({"payload": ["not", "an", "object"]}, "payload: must be a JSON object"),
        ({"payload": {"when": object()}}, r"payload.when: not a JSON value \(object\)"),
        ({"payload": {"text": "a\x00b"}}, r"payload.text: contains a NUL character"),
        ({"payload": _nested(100_000)}, "nested deeper than 32 levels"),
        ({"payload": {"blob": "x" * (300 * 1024)}}, "too large .* for a webhook"),
        (
            {"channel": "email", "destination": "a@example.com", "payload": {"text": "t"}},
            "'subject' is required for e-mail",
        ),
        (
            {"channel": "sms", "destination": "+14155550123", "payload": {"body": "x" * 1601}},
            "payload.body: too long",
        ),
    ],
)
async def test_invalid_intent_is_refused_and_the_transaction_stays_usable(
    pool: asyncpg.Pool, fields: dict[str, object], problem: str
) -> None:
    arguments: dict[str, object] = {
        "key": "order:1:paid:webhook",
        "channel": "webhook",
        "destination": "https://partner.example/hooks",
        "payload": {"order": 1},
        **fields,
    }
    async with pool.acquire() as conn, conn.transaction():
        with pytest.raises(outbox.InvalidIntentError, match=problem):
            await outbox.add_intent(conn, **arguments)  # type: ignore[arg-type]
        assert await conn.fetchval("SELECT 1") == 1
    assert await _count(pool) == 0


async def test_connection_without_jsonb_codec_gets_a_clear_error_until_prepared(
    settings: Settings,
) -> None:
    conn = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        async with conn.transaction():
            with pytest.raises(outbox.InvalidIntentError, match="prepare_connection") as raised:
                await outbox.add_intent(
                    conn,
                    key="a:1:email",
                    channel="email",
                    destination="a@example.com",
                    payload={"subject": "secret-subject", "text": "t"},
                )
            # Neither the message nor a chained driver error quotes the payload.
            assert "secret-subject" not in str(raised.value)
            assert raised.value.__cause__ is None and raised.value.__context__ is None
            await outbox.prepare_connection(conn)
            new_id = await outbox.add_intent(
                conn,
                key="a:1:email",
                channel="email",
                destination="a@example.com",
                payload={"subject": "s", "text": "t"},
            )
        assert new_id is not None
        assert await conn.fetchval("SELECT payload FROM deliveries") == {
            "subject": "s",
            "text": "t",
        }
    finally:
        await conn.close()


async def test_committed_webhook_intent_is_relayed_by_publish_and_delivered_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    async with pool.acquire() as conn, conn.transaction():
        new_id = await outbox.add_intent(
            conn,
            key="order:7:paid:webhook",
            channel="webhook",
            destination=partner.url("orders"),
            allow_networks=rs.LOOPBACK,
            payload={"order": 7},
        )

    published = await rs.relay(settings, "publish")
    assert published.code == 0, published.stderr
    assert await pool.fetchval("SELECT state::text FROM deliveries") == "queued"
    run = await _one(pool, "SELECT status, created_count, published_count FROM publish_runs")
    # The pending sweep published it; admission created nothing (no reminders).
    assert (run["status"], run["created_count"], run["published_count"]) == ("ok", 0, 1)

    async def delivered() -> bool:
        return bool(await pool.fetchval("SELECT state::text FROM deliveries") == "delivered")

    async with rs.consumer_in_process(settings):
        await rs.wait_for(delivered, 20, "the intent delivered")
        # A second run finds nothing pending: the intent is not sent again.
        again = await rs.relay(settings, "publish")
        assert again.code == 0, again.stderr

    row = await _one(pool, "SELECT * FROM deliveries")
    assert row["id"] == new_id and row["attempts"] == 1 and row["receipt"]
    assert partner.state.events == {"outbox:order:7:paid:webhook": 1}
    assert partner.state.accepted == {"outbox:order:7:paid:webhook": "orders"}
    assert partner.state.duplicates == 0 and partner.state.bad_signatures == 0
    attempts = await pool.fetch("SELECT outcome, payload_version FROM delivery_attempts")
    assert [(a["outcome"], a["payload_version"]) for a in attempts] == [("accepted", None)]


async def test_status_reports_outbox_intents_apart_from_runs(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await outbox.add_intent(
            conn,
            key="status-1",
            channel="webhook",
            destination=partner.url(),
            payload={"n": 1},
            allow_networks=rs.LOOPBACK,
        )
    report = await rs.relay(settings, "status", "--json")
    assert report.code == 0, report.stderr
    assert json.loads(report.stdout)["outbox"]["states"] == {"pending": 1}
    table = await rs.relay(settings, "status")
    assert "outbox intents (no run): pending=1; oldest pending" in table.stdout
