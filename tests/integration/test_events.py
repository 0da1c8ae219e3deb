"""Events at the door, against real PostgreSQL (and the real CLI): the catalogue, the
subscriptions, and the fan-out that ``outbox.add_event`` makes in the application's own
transaction -- once per event key, to the subscriptions in force then, each delivery keyed
by the event and its destination; a payload failing its type's schema refused in one line;
and the event's type reaching the webhook adapter (the envelope's ``type``)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from service import events, outbox
from service.ledger import intake
from service.settings import Settings
from tests.support import relay as rs
from tests.support.receivers import Receiver, delivered, keyed, receivers

__all__ = ["keyed", "receivers"]  # fixtures

pytestmark = pytest.mark.timeout(120)

A = "http://127.0.0.1:9/hooks/a"
B = "http://127.0.0.1:9/hooks/b"
C = "http://127.0.0.1:9/hooks/c"
DELAYED_SCHEMA = {
    "type": "object",
    "required": ["shipment", "eta"],
    "properties": {"shipment": {"type": "integer"}, "eta": {"type": "string"}},
}


async def _ok(settings: Settings, *args: str) -> str:
    result = await rs.relay(settings, *args)
    assert result.code == 0, result.stderr
    return result.stdout


async def _catalogue(settings: Settings, tmp_path: Path) -> None:
    schema = tmp_path / "delayed.json"
    schema.write_text(json.dumps(DELAYED_SCHEMA))
    await _ok(settings, "event-types", "add", "shipment.delayed", "--schema", str(schema))
    await _ok(settings, "event-types", "add", "shipment.delivered")
    await _ok(settings, "event-types", "add", "order.paid", "--description", "paid")


async def _add(pool: asyncpg.Pool, key: str, event_type: str, **payload: Any) -> Any:
    async with pool.acquire() as conn, conn.transaction():
        return await outbox.add_event(conn, key=key, event_type=event_type, payload=payload)


async def _owed(pool: asyncpg.Pool) -> dict[str, str]:
    """idempotency key -> destination of every event delivery."""
    rows = await pool.fetch("SELECT idempotency_key, destination FROM deliveries")
    return {r["idempotency_key"]: r["destination"] for r in rows}


async def _ids(pool: asyncpg.Pool) -> dict[str, int]:
    return {r["url"]: r["id"] for r in await pool.fetch("SELECT url, id FROM destinations")}


async def test_one_event_makes_one_delivery_per_subscribed_destination_keyed_by_both(
    keyed: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await _catalogue(keyed, tmp_path)
    for url in (A, B, C):
        await _ok(keyed, "destinations", "add", url)
    await _ok(keyed, "destinations", "subscribe", A, "shipment.*")
    await _ok(keyed, "destinations", "subscribe", B, "shipment.delayed", "--budget", "bee")
    await _ok(keyed, "destinations", "subscribe", B, "*")  # twice matched: still once
    await _ok(keyed, "destinations", "subscribe", C, "order.paid")

    recorded = await _add(pool, "s-1:delayed", "shipment.delayed", shipment=1, eta="10:00")

    assert recorded == intake.Recorded(recorded.event_id, 2)
    ids = await _ids(pool)
    assert await _owed(pool) == {
        events.delivery_key("s-1:delayed", ids[A]): A,
        events.delivery_key("s-1:delayed", ids[B]): B,
    }
    rows = await pool.fetch(
        "SELECT destination, provider, source, state::text AS state, event_type, event_id, "
        "payload FROM deliveries ORDER BY destination"
    )
    assert [(r["destination"], r["provider"]) for r in rows] == [(A, "webhook"), (B, "bee")]
    for r in rows:
        assert (r["source"], r["state"], r["event_type"]) == (
            "outbox",
            "pending",
            "shipment.delayed",
        )
        assert (r["event_id"], r["payload"]) == (recorded.event_id, {"shipment": 1, "eta": "10:00"})


async def test_the_same_event_recorded_twice_makes_nothing_new_even_for_a_new_subscriber(
    keyed: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await _catalogue(keyed, tmp_path)
    for url in (A, B):
        await _ok(keyed, "destinations", "add", url)
    await _ok(keyed, "destinations", "subscribe", A, "order.paid")
    assert (await _add(pool, "o-7:paid", "order.paid", order=7)).deliveries == 1
    await _ok(keyed, "destinations", "subscribe", B, "order.paid")

    assert await _add(pool, "o-7:paid", "order.paid", order=7) is None  # a retried transaction
    assert await _add(pool, "o-7:paid", "order.paid", order=8) is None  # the first one stands

    assert list((await _owed(pool)).values()) == [A]
    assert await pool.fetchval("SELECT count(*) FROM events") == 1
    assert await pool.fetchval("SELECT payload FROM events") == {"order": 7}


async def test_an_event_in_a_rolled_back_transaction_leaves_neither_event_nor_delivery(
    keyed: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await _catalogue(keyed, tmp_path)
    await _ok(keyed, "destinations", "add", A)
    await _ok(keyed, "destinations", "subscribe", A, "*")

    class Abort(Exception):
        pass

    async with pool.acquire() as conn:
        with pytest.raises(Abort):
            async with conn.transaction():
                done = await outbox.add_event(
                    conn, key="o-1:paid", event_type="order.paid", payload={"order": 1}
                )
                assert done is not None and done.deliveries == 1
                raise Abort
        with pytest.raises(outbox.NoTransactionError):
            await outbox.add_event(conn, key="o-1:paid", event_type="order.paid", payload={})
    assert await pool.fetchval("SELECT count(*) FROM events") == 0
    assert await _owed(pool) == {}


@pytest.mark.parametrize(
    ("payload", "event_type", "refusal"),
    [
        (
            {"shipment": 1},
            "shipment.delayed",
            "payload.eta: required by the schema of shipment.delayed",
        ),
        (
            {"shipment": "secret-value", "eta": "x"},
            "shipment.delayed",
            'payload.shipment: must be of type "integer" (the schema of shipment.delayed)',
        ),
        ({"a": 1}, "shipment.lost", "event_type: shipment.lost is not in the catalogue"),
        ({"a": 1}, "shipment..lost", "event_type: use dot-separated words"),
    ],
)
async def test_a_refused_event_is_one_line_naming_the_field_and_nothing_is_written(
    keyed: Settings,
    pool: asyncpg.Pool,
    tmp_path: Path,
    payload: dict[str, Any],
    event_type: str,
    refusal: str,
) -> None:
    await _catalogue(keyed, tmp_path)
    await _ok(keyed, "destinations", "add", A)
    await _ok(keyed, "destinations", "subscribe", A, "*")
    async with pool.acquire() as conn, conn.transaction():
        with pytest.raises(outbox.InvalidIntentError) as refused:
            await outbox.add_event(conn, key="k-1", event_type=event_type, payload=payload)
        # the caller's transaction is intact: a valid event still goes in
        await outbox.add_event(conn, key="k-2", event_type="order.paid", payload={"order": 2})
    message = str(refused.value)
    assert message.startswith(refusal) and "\n" not in message
    assert "secret-value" not in message
    assert list(await _owed(pool)) == [events.delivery_key("k-2", (await _ids(pool))[A])]


async def test_a_filter_takes_only_the_events_whose_fields_match(
    keyed: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await _catalogue(keyed, tmp_path)
    await _ok(keyed, "destinations", "add", A)
    await _ok(
        keyed, "destinations", "subscribe", A, "order.paid",
        "--filter", "region=eu", "--filter", "region=uk", "--filter", "priority=1",
    )  # fmt: skip
    cases = {
        "eu-1": {"region": "eu", "priority": 1},  # yes
        "uk-1": {"region": "uk", "priority": 1.0},  # yes: the same number
        "us-1": {"region": "us", "priority": 1},  # region not allowed
        "eu-2": {"region": "eu", "priority": 2},  # priority not allowed
        "eu-x": {"region": "eu"},  # priority missing
        "eu-s": {"region": "eu", "priority": "1"},  # a string is not the number
    }
    for key, payload in cases.items():
        await _add(pool, key, "order.paid", **payload)
    ids = await _ids(pool)
    assert set(await _owed(pool)) == {events.delivery_key(k, ids[A]) for k in ("eu-1", "uk-1")}


async def test_a_destination_subscribed_later_gets_earlier_events_only_by_backfill_and_once(
    keyed: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await _catalogue(keyed, tmp_path)
    for url in (A, B):
        await _ok(keyed, "destinations", "add", url)
    await _ok(keyed, "destinations", "subscribe", A, "order.*")
    for n in range(5):
        await _add(pool, f"o-{n}:paid", "order.paid", order=n)
    await _add(pool, "s-1:delivered", "shipment.delivered", shipment=1)
    await _ok(keyed, "destinations", "subscribe", B, "order.paid")
    assert set((await _owed(pool)).values()) == {A}  # no old event reached B on its own

    since = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    out = await _ok(
        keyed, "destinations", "subscribe", B, "order.paid", "--backfill-since", since, "--json"
    )
    assert json.loads(out)["backfilled"] == 5
    again = await _ok(
        keyed, "destinations", "subscribe", B, "order.paid", "--backfill-since", since, "--json"
    )
    assert json.loads(again)["backfilled"] == 0  # the same keys: nothing twice
    ids = await _ids(pool)
    b_keys = {k for k, url in (await _owed(pool)).items() if url == B}
    assert b_keys == {events.delivery_key(f"o-{n}:paid", ids[B]) for n in range(5)}
    await _add(pool, "o-9:paid", "order.paid", order=9)  # from now on, without a backfill
    assert sum(1 for url in (await _owed(pool)).values() if url == B) == 6


async def test_catalogue_commands_print_json_and_refuse_an_invalid_schema_with_exit_2(
    keyed: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await _catalogue(keyed, tmp_path)
    await _ok(keyed, "destinations", "add", A)
    await _ok(keyed, "destinations", "subscribe", A, "shipment.*", "--filter", "region=eu")
    listed = json.loads(await _ok(keyed, "event-types", "list", "--json"))["event_types"]
    assert [(t["name"], t["subscribers"]) for t in listed] == [
        ("order.paid", 0),
        ("shipment.delayed", 1),
        ("shipment.delivered", 1),
    ]
    shown = json.loads(await _ok(keyed, "event-types", "show", "shipment.delayed", "--json"))
    assert shown["schema"] == DELAYED_SCHEMA
    assert [(s["url"], s["pattern"], s["filter"]) for s in shown["subscriptions"]] == [
        (A, "shipment.*", {"region": ["eu"]})
    ]
    # a description change keeps the schema; --no-schema removes it
    await _ok(keyed, "event-types", "add", "shipment.delayed", "--description", "late")
    assert await pool.fetchval("SELECT schema FROM event_types WHERE name = 'shipment.delayed'")
    await _ok(keyed, "event-types", "add", "shipment.delayed", "--no-schema")
    assert await pool.fetchrow(
        "SELECT description, schema FROM event_types WHERE name = 'shipment.delayed'"
    ) == ("late", None)

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "no-such-type"}))
    refused = await rs.relay(keyed, "event-types", "add", "order.paid", "--schema", str(bad))
    assert refused.code == 2
    assert refused.stderr.startswith("relay: bad input: --schema: not a valid JSON Schema")
    assert refused.stderr.count("\n") == 1
    missing = await rs.relay(keyed, "event-types", "show", "order.lost")
    assert missing.code == 1 and "no event type order.lost" in missing.stderr


async def test_subscribe_refuses_an_unknown_destination_or_type_and_unsubscribe_keeps_owed(
    keyed: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await _catalogue(keyed, tmp_path)
    unknown = await rs.relay(keyed, "destinations", "subscribe", A, "order.paid")
    assert unknown.code == 1 and "no destination" in unknown.stderr
    await _ok(keyed, "destinations", "add", A)
    typo = await rs.relay(keyed, "destinations", "subscribe", A, "order.payd")
    assert typo.code == 2 and "no event type 'order.payd' in the catalogue" in typo.stderr
    bad = await rs.relay(keyed, "destinations", "subscribe", A, "order.*.x")
    assert bad.code == 2
    assert await pool.fetchval("SELECT count(*) FROM event_subscriptions") == 0

    await _ok(keyed, "destinations", "subscribe", A, "order.paid")
    await _add(pool, "o-1:paid", "order.paid", order=1)
    shown = json.loads(await _ok(keyed, "destinations", "show", A, "--json"))
    assert [s["pattern"] for s in shown["subscriptions"]] == ["order.paid"]
    await _ok(keyed, "destinations", "unsubscribe", A, "order.paid")
    again = await rs.relay(keyed, "destinations", "unsubscribe", A, "order.paid")
    assert again.code == 1
    await _add(pool, "o-2:paid", "order.paid", order=2)
    assert len(await _owed(pool)) == 1  # the owed one stays; nothing new


async def test_an_enveloped_partner_gets_the_event_type_and_a_plain_one_the_payload(
    keyed: Settings, pool: asyncpg.Pool, tmp_path: Path, receivers: list[Receiver]
) -> None:
    """Through publish, a consumer's claim and last check, to the webhook adapter: the
    event's type is the envelope's ``type``; without the envelope the body is the payload."""
    await _catalogue(keyed, tmp_path)
    enveloped, plain = receivers
    await _ok(keyed, "destinations", "add", enveloped.url(), "--envelope")
    await _ok(keyed, "destinations", "add", plain.url())
    for receiver in receivers:
        await _ok(keyed, "destinations", "subscribe", receiver.url(), "order.*")
    await _add(pool, "o-9:paid", "order.paid", order=9)
    assert (await rs.relay(keyed, "publish")).code == 0
    async with rs.consumer_in_process(keyed):
        await rs.wait_for(lambda: delivered(pool, 2), 60, "both deliveries delivered")

    [sent] = enveloped.requests
    body = json.loads(sent.body)
    assert (body["type"], body["data"]) == ("order.paid", {"order": 9})
    [raw] = plain.requests
    assert json.loads(raw.body) == {"order": 9}
    rows = await pool.fetch("SELECT source, event_type, attempts FROM deliveries")
    assert [tuple(r) for r in rows] == [("outbox", "order.paid", 1)] * 2
