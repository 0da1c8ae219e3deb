"""Events end to end against real PostgreSQL, RabbitMQ, consumers and partner endpoints:
three partners subscribed differently to four event types each get exactly the events
they chose, once per key, signed with their own secret; one partner down for 30 s delays
nobody else; disabling one holds only its own deliveries (and the report, ``deliveries
show`` and the console follow each delivery of an event)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import pytest
from aiohttp import web

from service import events, outbox
from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import console as cs
from tests.support import relay as rs
from tests.support.receivers import Received, keyed, revealed, verifies

__all__ = ["keyed"]  # fixtures

TYPES = ("shipment.delayed", "shipment.delivered", "order.paid", "order.refunded")


@dataclass
class Partner:
    """A partner endpoint: keeps every accepted request; while ``down`` it hangs past the
    relay's HTTP timeout and then answers 503 (nothing it answers then is accepted)."""

    name: str
    port: int = 0
    down: bool = False
    rejecting: bool = False  # answer 400: a permanent refusal (the delivery dies)
    accepted: list[Received] = field(default_factory=list)
    refused: int = 0

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/{self.name}"

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if self.down:
            self.refused += 1
            await asyncio.sleep(3)  # longer than http_timeout_seconds (2 s): a hang
            return web.Response(status=503)
        if self.rejecting:
            return web.Response(status=400)
        self.accepted.append(Received(request.path, body, dict(request.headers)))
        return web.json_response({"ok": True})

    def keys(self) -> list[str]:
        return [r.headers["webhook-id"] for r in self.accepted]


@pytest.fixture
async def partners() -> AsyncIterator[list[Partner]]:
    made: list[tuple[Partner, web.AppRunner]] = []
    for name in ("carrier", "shop", "support"):
        partner = Partner(name)
        app = web.Application()
        app.router.add_post("/hooks/{name}", partner.handle)
        runner, partner.port = await partner_mod.serve(app)
        made.append((partner, runner))
    yield [p for p, _ in made]
    for _, runner in made:
        await runner.cleanup()


async def _ok(settings: Settings, *args: str) -> str:
    result = await rs.relay(settings, *args)
    assert result.code == 0, result.stderr
    return result.stdout


async def _setup(settings: Settings, partners: list[Partner]) -> dict[str, str]:
    """The catalogue, the partners registered with own secrets and subscribed differently:
    the carrier every shipment.*, the shop order.paid and EU shipment.delayed, support
    every order.* and shipment.delivered. Returns each partner's secret."""
    for name in TYPES:
        await _ok(settings, "event-types", "add", name)
    carrier, shop, support = partners
    subscribe = [
        (carrier, "shipment.*"),
        (shop, "order.paid"),
        (shop, "shipment.delayed", "--filter", "region=eu"),
        (support, "order.*"),
        (support, "shipment.delivered"),
    ]
    secrets = {}
    for p in partners:
        await _ok(settings, "destinations", "add", p.url())
        [secrets[p.name]] = await revealed(settings, p.url())
    for p, *args in subscribe:
        await _ok(settings, "destinations", "subscribe", p.url(), *args)
    return secrets


def _payload(n: int) -> dict[str, Any]:
    return {"n": n, "region": "eu" if n % 3 == 0 else "us"}


def _wanted(partner: str, event_type: str, payload: dict[str, Any]) -> bool:
    """The subscriptions above, written out independently of the relay's matching."""
    if partner == "carrier":
        return event_type.startswith("shipment.")
    if partner == "shop":
        return event_type == "order.paid" or (
            event_type == "shipment.delayed" and payload["region"] == "eu"
        )
    return event_type.startswith("order.") or event_type == "shipment.delivered"


async def _record(pool: asyncpg.Pool, count: int, batch: int = 100) -> None:
    """``count`` events, several per application transaction."""
    for start in range(0, count, batch):
        async with pool.acquire() as conn, conn.transaction():
            for n in range(start, min(start + batch, count)):
                await outbox.add_event(
                    conn, key=f"e-{n}", event_type=TYPES[n % 4], payload=_payload(n)
                )


async def _expected(pool: asyncpg.Pool, partners: list[Partner], count: int) -> dict[str, set[str]]:
    ids = {r["url"]: r["id"] for r in await pool.fetch("SELECT url, id FROM destinations")}
    return {
        p.name: {
            events.delivery_key(f"e-{n}", ids[p.url()])
            for n in range(count)
            if _wanted(p.name, TYPES[n % 4], _payload(n))
        }
        for p in partners
    }


async def _delivered(pool: asyncpg.Pool, url: str) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM deliveries WHERE destination = $1 AND state = 'delivered'", url
        )
    )


async def _publish(settings: Settings) -> None:
    result = await rs.relay(settings, "publish", timeout=300)
    assert result.code == 0, result.stderr


@pytest.mark.timeout(900)
async def test_three_partners_get_exactly_their_events_once_each_signed_with_its_own_secret(
    keyed: Settings, pool: asyncpg.Pool, partners: list[Partner]
) -> None:
    secrets = await _setup(keyed, partners)
    await _record(pool, 1000)
    expected = await _expected(pool, partners, 1000)
    total = sum(map(len, expected.values()))
    assert await pool.fetchval("SELECT count(*) FROM deliveries") == total
    await _publish(keyed)
    async with rs.consumer_in_process(keyed):

        async def all_delivered() -> bool:
            return (await rs.states(pool)).get("delivered", 0) == total

        await rs.wait_for(all_delivered, 600, f"{total} deliveries delivered", interval=1)

    payloads = {f"e-{n}": _payload(n) for n in range(1000)}
    for p in partners:
        keys = p.keys()
        assert len(keys) == len(set(keys)), f"{p.name}: a key accepted twice"
        assert set(keys) == expected[p.name], p.name
        for request in p.accepted:
            assert verifies(secrets[p.name], request), p.name
            assert not any(verifies(s, request) for n, s in secrets.items() if n != p.name)
            event_key = request.headers["webhook-id"].split(":")[1]
            assert json.loads(request.body) == payloads[event_key]
    assert {p.name: len(p.accepted) for p in partners} == {
        "carrier": 500,  # every shipment.*
        "shop": 250 + 84,  # order.paid; shipment.delayed of the eu (n % 3 == 0) ones
        "support": 500 + 250,  # order.*; shipment.delivered
    }


@pytest.mark.timeout(900)
async def test_a_partner_down_for_30_seconds_delays_nobody_else(
    keyed: Settings, pool: asyncpg.Pool, partners: list[Partner]
) -> None:
    settings = keyed.model_copy(update={"max_attempts": 100})  # an outage is not a death
    await _setup(settings, partners)
    carrier, shop, support = partners
    support.down = True
    went_down = time.monotonic()
    await _record(pool, 400)
    expected = await _expected(pool, partners, 400)
    await _publish(settings)
    async with rs.consumer_in_process(settings):

        async def others_done_and_30_s_down() -> bool:
            if time.monotonic() - went_down < 30 or support.refused == 0:
                return False
            for p in (carrier, shop):
                if await _delivered(pool, p.url()) < len(expected[p.name]):
                    return False
            return True

        # Down for at least 30 s, and for as long as the others are not all served: on a
        # slow machine the window stretches rather than the test guessing a duration.
        await rs.wait_for(others_done_and_30_s_down, 600, "the others served", interval=0.5)
        back_at = await pool.fetchval("SELECT clock_timestamp()")
        support.down = False

        async def support_done() -> bool:
            return await _delivered(pool, support.url()) == len(expected["support"])

        await rs.wait_for(support_done, 600, "support served after it came back", interval=1)

    others = await pool.fetchval(
        "SELECT max(finished_at) FROM deliveries WHERE destination = ANY($1::text[])",
        [carrier.url(), shop.url()],
    )
    assert others < back_at  # every other partner's event reached it while support was down
    failed = await pool.fetchval(
        "SELECT count(*) FROM delivery_attempts AS a JOIN deliveries AS d ON d.id = a.delivery_id "
        "WHERE d.destination = $1 AND a.outcome <> 'accepted' AND a.finished_at < $2",
        support.url(),
        back_at,
    )
    assert failed > 0  # support really was failing meanwhile
    first_accepted = await pool.fetchval(
        "SELECT min(finished_at) FROM deliveries WHERE destination = $1", support.url()
    )
    assert first_accepted > back_at
    for p in partners:
        assert sorted(p.keys()) == sorted(expected[p.name]), p.name  # each once, all of them


@pytest.mark.timeout(600)
async def test_disabling_a_partner_holds_only_its_deliveries_and_each_tool_follows_the_event(
    keyed: Settings, pool: asyncpg.Pool, partners: list[Partner]
) -> None:
    settings = keyed.model_copy(update={"destination_hold_seconds": 1.0})
    await _setup(settings, partners)
    shop = partners[1]
    await _ok(settings, "destinations", "disable", shop.url(), "--reason", "migrating")
    await _record(pool, 24)
    expected = await _expected(pool, partners, 24)
    await _publish(settings)
    async with rs.consumer_in_process(settings):
        others = {p.name: len(expected[p.name]) for p in partners if p is not shop}

        async def others_done() -> bool:
            done = [await _delivered(pool, p.url()) for p in partners if p is not shop]
            return done == list(others.values())

        await rs.wait_for(others_done, 120, "the enabled partners served")
        assert shop.accepted == []
        held = await pool.fetchval(
            "SELECT count(*) FROM deliveries WHERE destination = $1 "
            "AND state IN ('pending', 'queued', 'retrying')",
            shop.url(),
        )
        assert held == len(expected["shop"])
        await _follow_one_event(settings, pool, shop)

        await _ok(settings, "destinations", "enable", shop.url(), "--reason", "back", "--apply")

        async def shop_done() -> bool:
            return await _delivered(pool, shop.url()) == len(expected["shop"])

        await rs.wait_for(shop_done, 120, "the shop served after its enable")
    assert sorted(shop.keys()) == sorted(expected["shop"])
    assert await pool.fetchval("SELECT count(*) FROM delivery_attempts") == sum(
        map(len, expected.values())
    )  # holding it cost no attempt


async def _follow_one_event(settings: Settings, pool: asyncpg.Pool, shop: Partner) -> None:
    """While the shop is disabled: the report's --missing groups its rows by event,
    ``deliveries show`` names the event, and the console's event page lists every delivery."""
    report = json.loads(await _ok(settings, "status", "--missing", "--all-runs", "--json"))
    groups = report["event_missing"]
    assert groups and all(len(g["missing"]) == 1 for g in groups)
    shown = {r["destination"] for g in groups for r in g["missing"]}
    assert shown == {f"http://127.0.0.1:{shop.port}"}
    assert report["outbox_missing"] == []
    text = await _ok(settings, "status", "--missing")
    first = groups[0]
    assert f"event {first['event_id']} {first['event_type']} {first['key']}" in text
    event_id = await pool.fetchval(
        "SELECT e.id FROM events AS e WHERE e.key = 'e-2'"  # order.paid: shop and support
    )
    shop_row = await pool.fetchval(
        "SELECT id FROM deliveries WHERE event_id = $1 AND destination = $2", event_id, shop.url()
    )
    story = json.loads(await _ok(settings, "deliveries", "show", str(shop_row), "--json"))
    assert story["event"]["key"] == "e-2" and story["event"]["deliveries"] == 2
    async with cs.console(settings) as c, cs.client() as http:
        await cs.log_in(http, c.url)
        async with http.get(f"{c.url}/events/{event_id}") as page:
            assert page.status == 200
            html = await page.text()
        async with http.get(f"{c.url}/events") as page:
            assert f'href="/events/{event_id}"' in await page.text()
        async with http.get(f"{c.url}/api/v1/events/{event_id}") as answer:
            found = await answer.json()
        async with http.get(f"{c.url}/deliveries/{shop_row}") as page:
            assert f'href="/events/{event_id}"' in await page.text()
    rows = {d["id"]: d for d in found["delivery_list"]}
    assert len(rows) == 2 and rows[shop_row]["destination_disabled"] is True
    # redacted as everywhere in the console, named by the keyed reference
    assert rows[shop_row]["destination"] == f"http://127.0.0.1:{shop.port}"
    assert rows[shop_row]["destination_ref"] == await cs.ref_of(pool, shop.url())
    assert shop.url() not in html and rows[shop_row]["destination_ref"] in html
    for delivery_id in rows:
        assert f'href="/deliveries/{delivery_id}"' in html
    assert "(disabled: held)" in html


@pytest.mark.timeout(600)
async def test_a_partner_refusing_dead_letters_only_its_deliveries_and_a_replay_sends_them_once(
    keyed: Settings, pool: asyncpg.Pool, partners: list[Partner]
) -> None:
    await _setup(keyed, partners)
    carrier, shop, support = partners
    shop.rejecting = True
    await _record(pool, 24)
    expected = await _expected(pool, partners, 24)
    await _publish(keyed)
    async with rs.consumer_in_process(keyed):

        async def settled() -> bool:
            dead = await pool.fetchval(
                "SELECT count(*) FROM deliveries WHERE destination = $1 AND state = 'dead'",
                shop.url(),
            )
            others = [await _delivered(pool, p.url()) for p in (carrier, support)]
            return dead == len(expected["shop"]) and others == [
                len(expected["carrier"]),
                len(expected["support"]),
            ]

        await rs.wait_for(settled, 120, "the shop's deliveries dead, the others delivered")
        shop.rejecting = False
        replayed = await rs.relay(keyed, "replay", "--from", "ledger", "--apply", "--json")
        assert replayed.code == 0, replayed.stderr
        assert json.loads(replayed.stdout)["replayed"] == len(expected["shop"])

        async def shop_done() -> bool:
            return await _delivered(pool, shop.url()) == len(expected["shop"])

        await rs.wait_for(shop_done, 120, "the shop's deliveries replayed and delivered")
    for p in partners:
        assert sorted(p.keys()) == sorted(expected[p.name]), p.name
    replays = await pool.fetchval(
        "SELECT count(*) FROM deliveries WHERE replays > 0 AND destination <> $1", shop.url()
    )
    assert replays == 0  # the replay touched the dead ones only
