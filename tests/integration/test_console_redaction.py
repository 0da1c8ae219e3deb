"""Least data shown, over real HTTP against a real ledger: the console redacts a
destination and a partner's reply exactly as ``relay deliveries show`` does (the same
function); revealing a page is a deliberate, CSRF-guarded POST that is recorded (who,
when, which page), and the JSON API never reveals; destination references are keyed
hashes (HMAC with this deployment's secret), not a plain SHA-256 of the address. An
event's page and its JSON follow the same rules."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime, timedelta

import aiohttp
import asyncpg

from service.settings import Settings
from tests.support import console as cs
from tests.support import relay as rs
from tests.support.receivers import keyed

__all__ = ["keyed"]  # fixtures

PRIVATE_PATH = "/hooks/t0k3n-secret?key=s3cr3t"
REPLY = (
    "unknown recipient dr.who@clinic.example; call +4915112345678 or see "
    "https://partner.example/help?token=abc"
)
HIDDEN = ("t0k3n-secret", "s3cr3t", "dr.who@clinic.example", "+4915112345678", "token=abc")


async def _page(http: aiohttp.ClientSession, url: str, **form: str) -> str:
    call = http.post(url, data=form) if form else http.get(url)
    async with call as answer:
        assert answer.status == 200, (url, answer.status, await answer.text())
        return await answer.text()


async def test_the_console_redacts_as_the_cli_and_a_reveal_is_recorded_per_page(
    keyed: Settings, pool: asyncpg.Pool
) -> None:
    async with cs.answering(REPLY) as base, rs.consumer_in_process(keyed):
        destination = base + PRIVATE_PATH
        victim = await cs.dead_delivery(keyed, pool, "clinic-private", destination)
        event = await cs.dead_event(
            keyed, pool, "visit:1:booked", base + "/events" + PRIVATE_PATH, {"n": 1}
        )
    run_id = await pool.fetchval("SELECT run_id FROM deliveries WHERE id = $1", victim)
    cli = await rs.relay(keyed, "deliveries", "show", str(victim), "--json")
    assert cli.code == 0, cli.stderr
    story = json.loads(cli.stdout)
    (attempt,) = story["attempt_history"]
    assert attempt["reply_excerpt"].startswith("unknown recipient <email>")
    async with cs.console(keyed) as c, cs.client() as http:
        async with http.get(f"{c.url}/api/v1/deliveries/{victim}", headers=cs.bearer()) as api:
            shown = await api.json()
        # The same function, the same words: the CLI's document and the console's answer.
        assert shown["destination"] == story["destination"] == base
        assert shown["last_error"] == story["last_error"]
        assert shown["attempt_list"][0]["response_excerpt"] == attempt["reply_excerpt"]
        assert shown["attempt_list"][0]["error"] == attempt["error"]
        async with http.get(f"{c.url}/api/v1/events/{event.event_id}", headers=cs.bearer()) as api:
            (event_row,) = (await api.json())["delivery_list"]
        assert event_row["destination"] == base and event_row["last_error"] == story["last_error"]
        assert event_row["destination_ref"] == await cs.ref_of(
            pool, base + "/events" + PRIVATE_PATH
        )
        csrf = await cs.log_in(http, c.url)
        pages = [
            f"/deliveries/{victim}",
            f"/runs/{run_id}",
            "/destinations",
            f"/dead?run={run_id}",
            f"/events/{event.event_id}",
        ]
        for path in pages:
            page = await _page(http, c.url + path)
            assert not [h for h in HIDDEN if h in page], path
            assert 'id="reveal"' in page, path
        async with http.post(f"{c.url}/deliveries/{victim}", data={"reveal": "1"}) as answer:
            assert answer.status == 403  # no CSRF token: nothing revealed, nothing recorded
        assert await pool.fetchval("SELECT count(*) FROM console_reveals") == 0

        before = datetime.now(UTC)
        revealed = await _page(http, f"{c.url}/deliveries/{victim}", csrf=csrf, reveal="1")
        assert 'id="revealed"' in revealed
        assert "t0k3n-secret?key=s3cr3t" in revealed and "dr.who@clinic.example" in revealed
        for path in pages[1:]:
            page = await _page(http, c.url + path, csrf=csrf, reveal="1")
            assert 'id="revealed"' in page, path
            if "dead" not in path:  # the dead letters list shows no destination
                assert "t0k3n-secret?key=s3cr3t" in page, path
        again = await _page(http, f"{c.url}/deliveries/{victim}")
        assert "t0k3n-secret" not in again  # one reveal, one page view
        async with http.get(
            f"{c.url}/api/v1/deliveries/{victim}?reveal=1", headers=cs.bearer()
        ) as api:
            assert (await api.json())["destination"] == base  # the API never reveals
        async with http.get(
            f"{c.url}/api/v1/events/{event.event_id}?reveal=1", headers=cs.bearer()
        ) as api:
            assert (await api.json())["delivery_list"][0]["destination"] == base
    recorded = await pool.fetch("SELECT operator, page, at FROM console_reveals ORDER BY id")
    assert [(r["operator"], r["page"]) for r in recorded] == [("alice (console)", p) for p in pages]
    assert all(before - timedelta(seconds=5) <= r["at"] <= datetime.now(UTC) for r in recorded)


async def test_without_a_session_nothing_is_revealed_even_with_open_reads(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    await rs.load(pool, [rs.line("clinic-1", "http://127.0.0.1:9" + PRIVATE_PATH)])
    async with cs.console(settings, open_reads=True) as c, cs.client() as http:
        page = await _page(http, f"{c.url}/destinations")
        assert "t0k3n-secret" not in page and 'id="reveal"' not in page
        async with http.post(f"{c.url}/destinations", data={"reveal": "1"}) as answer:
            assert answer.status == 401
    assert await pool.fetchval("SELECT count(*) FROM console_reveals") == 0


async def test_destination_references_are_keyed_by_the_deployment_secret(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    destination = "http://127.0.0.1:9/hooks/clinic-7"
    await rs.load(pool, [rs.line("clinic-7", destination)])
    seen = []
    for _ in range(2):  # a restarted console keeps its key (and so every reference)
        async with (
            cs.console(settings) as c,
            cs.client(headers=cs.bearer()) as http,
            http.get(f"{c.url}/api/v1/destinations") as answer,
        ):
            (found,) = (await answer.json())["destinations"]
            seen.append(found["destination_ref"])
    assert seen[0] == seen[1] == await cs.ref_of(pool, destination)
    assert re.fullmatch(r"[0-9a-f]{16}", seen[0])
    assert seen[0] != hashlib.sha256(destination.encode()).hexdigest()[:16]
    secret = await pool.fetchval("SELECT secret FROM console_secrets")
    assert len(secret) == 32 and await pool.fetchval("SELECT count(*) FROM console_secrets") == 1
