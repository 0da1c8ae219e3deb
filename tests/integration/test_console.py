"""The operator console over real HTTP, against real PostgreSQL, RabbitMQ and a consumer:
the token, the session cookie and CSRF guard every action; runs lead to who did not get
it, to one delivery's attempts, to a dry run and an applied replay that gets delivered;
the pages and /api/v1 show the ledger's facts."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import cast

import aiohttp
import asyncpg

from service.settings import Settings
from tests.support import console as cs
from tests.support import forked
from tests.support import relay as rs
from tests.support.relay import RunningPartner

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_TITLE = re.compile(r"<title>(.*?)</title>", re.S)
_HREF = re.compile(r'(?:href|action)="([^"]*)"')


def _secure(answer: aiohttp.ClientResponse) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert value in answer.headers.get(name, ""), (answer.url, name)
    assert "frame-ancestors 'none'" in answer.headers["Content-Security-Policy"]


async def _page(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url, allow_redirects=False) as answer:
        assert answer.status == 200, (url, answer.status)
        _secure(answer)
        return await answer.text()


def _no_address_in_title_or_links(page: str, address: str) -> None:
    title = _TITLE.search(page)
    assert title is not None and address not in title.group(1)
    assert all(address not in link and "@" not in link for link in _HREF.findall(page))


async def test_every_action_needs_the_token_and_a_session_needs_its_csrf_token(
    settings: Settings,
) -> None:
    async with cs.console(settings) as c, cs.client() as http:
        async with http.get(f"{c.url}/runs", allow_redirects=False) as answer:
            assert answer.status == 303 and answer.headers["Location"] == "/login"
            _secure(answer)
        async with http.get(f"{c.url}/api/v1/runs") as answer:
            assert answer.status == 401
            _secure(answer)
        async with http.post(f"{c.url}/api/v1/replay", json={"apply": True}) as answer:
            assert answer.status == 401
        async with http.post(f"{c.url}/replay", data={"apply": "1", "reason": "x"}) as answer:
            assert answer.status == 401
        wrong = {"Authorization": "Bearer not-the-token-at-all-000"}
        async with http.get(f"{c.url}/api/v1/runs", headers=wrong) as answer:
            assert answer.status == 401
        async with http.post(
            f"{c.url}/login", data={"name": "mallory", "token": "wrong"}, allow_redirects=False
        ) as answer:
            assert answer.status == 401 and "Set-Cookie" not in answer.headers
        login = await _page(http, f"{c.url}/login")
        assert "<title>Log in — relay console</title>" in login

        async with http.post(
            f"{c.url}/login", data={"name": "alice", "token": cs.TOKEN}, allow_redirects=False
        ) as answer:
            cookie = answer.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        csrf = await cs.log_in(http, c.url)
        form = {"run_id": "1", "apply": "1", "reason": "forged"}
        async with http.post(f"{c.url}/replay", data=form) as answer:
            assert answer.status == 403  # no CSRF token
        async with http.post(f"{c.url}/replay", data=form | {"csrf": "0" * 64}) as answer:
            assert answer.status == 403  # a wrong one
            _secure(answer)
        async with http.post(f"{c.url}/api/v1/replay", json={"run_id": 1}) as answer:
            assert answer.status == 403  # the cookie alone does not make an API call
        evil = {"Origin": "http://evil.example"}
        async with http.post(f"{c.url}/replay", data=form | {"csrf": csrf}, headers=evil) as answer:
            assert answer.status == 403
        async with http.post(f"{c.url}/replay", data={"run_id": "1", "csrf": csrf}) as answer:
            assert answer.status == 200  # the same session with its token: a dry run
            assert "Would replay" in await answer.text()


async def test_from_the_runs_page_to_a_missing_delivery_its_attempts_and_a_replay_delivered(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    async with rs.consumer_in_process(settings):
        failed = await cs.run_with_failures(settings, pool, partner)
        victim = failed.dead[0]
        async with cs.console(settings) as c, cs.client() as http:
            csrf = await cs.log_in(http, c.url)
            runs_page = await _page(http, f"{c.url}/runs")
            assert f'href="/runs/{failed.run_id}"' in runs_page
            assert "60.0 %" in runs_page  # 3 of 5 delivered

            run_page = await _page(http, f"{c.url}/runs/{failed.run_id}")
            assert f"<title>Run {failed.run_id} — relay console</title>" in run_page
            listed = [int(i) for i in re.findall(r'id="delivery-(\d+)"', run_page)]
            assert listed == failed.dead
            _no_address_in_title_or_links(run_page, partner.url("bad"))
            none = await _page(http, f"{c.url}/runs/{failed.run_id}?channel=email")
            assert re.findall(r'id="delivery-(\d+)"', none) == []

            delivery_page = await _page(http, f"{c.url}/deliveries/{victim}")
            assert f"<title>Delivery {victim} — relay console</title>" in delivery_page
            assert 'id="delivery-state">dead<' in delivery_page
            assert "<td>400</td>" in delivery_page and "rejected" in delivery_page
            _no_address_in_title_or_links(delivery_page, partner.url("bad"))

            dry = {"delivery_id": str(victim), "csrf": csrf}
            async with http.post(f"{c.url}/replay", data=dry) as answer:
                assert answer.status == 200
                assert "Would replay <strong>1</strong>" in await answer.text()
            assert (
                await pool.fetchval("SELECT state::text FROM deliveries WHERE id=$1", victim)
                == "dead"
            )
            async with http.post(f"{c.url}/replay", data=dry | {"apply": "1"}) as answer:
                assert answer.status == 400  # no reason given: nothing done
            assert await pool.fetchval("SELECT count(*) FROM replays") == 0

            del partner.state.rules["bad"]  # the receiver is fixed
            applied = dry | {"apply": "1", "reason": "receiver fixed (INC-7)"}
            async with http.post(f"{c.url}/replay", data=applied) as answer:
                assert answer.status == 200
                assert "Replayed <strong>1</strong>" in await answer.text()

            async def delivered() -> bool:
                page = await _page(http, f"{c.url}/deliveries/{victim}")
                return 'id="delivery-state">delivered<' in page

            await rs.wait_for(delivered, 30, "the replayed delivery to be delivered")
            page = await _page(http, f"{c.url}/deliveries/{victim}")
            assert page.count('<span class="outcome') == 2  # rejected, then accepted
        audit = await pool.fetchrow("SELECT operator, filters, selected, replayed FROM replays")
        assert audit["operator"] == "alice (console)"
        assert audit["filters"]["reason"] == "receiver fixed (INC-7)"
        assert (audit["selected"], audit["replayed"]) == (1, 1)
        states = dict(await pool.fetch("SELECT id, state::text FROM deliveries"))
        assert states[victim] == "delivered" and states[failed.dead[1]] == "dead"


async def test_the_api_shows_the_ledger_and_replays_a_run_dry_run_first(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    auth = cs.bearer("ops-bot")
    async with rs.consumer_in_process(settings):
        failed = await cs.run_with_failures(settings, pool, partner)
        async with cs.console(settings) as c, cs.client(headers=auth) as http:
            async with http.get(f"{c.url}/api/v1/runs") as answer:
                runs = (await answer.json())["runs"]
            assert [r["run_id"] for r in runs if r["created"]] == [failed.run_id]
            assert runs[0]["states"] == {"delivered": 3, "dead": 2}
            async with http.get(f"{c.url}/api/v1/runs/{failed.run_id}/missing") as answer:
                missing = (await answer.json())["missing"]
            assert [m["id"] for m in missing] == failed.dead
            ref = missing[0]["destination_ref"]
            query = f"?state=dead&destination={ref}"
            async with http.get(f"{c.url}/api/v1/runs/{failed.run_id}/missing{query}") as answer:
                assert [m["id"] for m in (await answer.json())["missing"]] == failed.dead
            async with http.get(f"{c.url}/api/v1/deliveries/{failed.dead[0]}") as answer:
                story = await answer.json()
            assert story["state"] == "dead" and "payload" not in story
            assert [(a["outcome"], a["http_status"]) for a in story["attempt_list"]] == [
                ("rejected", 400)
            ]
            async with http.get(f"{c.url}/api/v1/dead?run={failed.run_id}") as answer:
                dead = await answer.json()
            assert sorted(d["id"] for d in dead["deliveries"]) == failed.dead

            dry = {"run_id": failed.run_id}
            async with http.post(f"{c.url}/api/v1/replay", json=dry) as answer:
                summary = await answer.json()
            assert (summary["apply"], summary["replayed"]) == (False, 2)
            assert await rs.states(pool) == {"delivered": 3, "dead": 2}
            del partner.state.rules["bad"]
            applied = dry | {"apply": True, "reason": "receiver fixed"}
            async with http.post(f"{c.url}/api/v1/replay", json=applied) as answer:
                assert (await answer.json())["replayed"] == 2

            async def all_delivered() -> bool:
                return await rs.states(pool) == {"delivered": 5}

            await rs.wait_for(all_delivered, 30, "the replayed run to be delivered")
    assert await pool.fetchval("SELECT operator FROM replays") == "ops-bot (console)"


async def test_destinations_are_disabled_and_enabled_with_a_reason(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(
        pool, [rs.line("clinic-1", partner.url("ok")), rs.line("clinic-2", partner.url("ok"))]
    )
    async with cs.console(settings) as c, cs.client() as http:
        csrf = await cs.log_in(http, c.url, "bob")
        page = await _page(http, f"{c.url}/destinations")
        refs = re.findall(r'action="/destinations/([0-9a-f]{16})/disable"', page)
        assert len(refs) == 1
        url = f"{c.url}/destinations/{refs[0]}/disable"
        async with http.post(url, data={"csrf": csrf}) as answer:
            assert answer.status == 400  # no reason
        async with http.post(url, data={"csrf": csrf, "reason": "clinic closed"}) as answer:
            assert answer.status == 200 and "2 reminders paused" in await answer.text()
        reason = await pool.fetchval("SELECT reason FROM disabled_destinations")
        assert reason == "operator: clinic closed"  # as `relay destinations disable` writes
        action = await pool.fetchrow("SELECT operator, reason FROM destination_actions")
        assert tuple(action) == ("bob (console)", "clinic closed")
        # Disabled holds the destination's deliveries and pauses its reminders.
        assert await pool.fetchval("SELECT state FROM destinations WHERE state = 'disabled'")
        paused = await pool.fetch("SELECT inactive_reason FROM reminders WHERE NOT active")
        assert [r["inactive_reason"] for r in paused] == ["destination_disabled"] * 2
        auth = cs.bearer("bob")
        enable = f"{c.url}/api/v1/destinations/{refs[0]}/enable"
        async with http.post(enable, json={"reason": "reopened"}, headers=auth) as answer:
            dry = await answer.json()
        assert (dry["apply"], dry["changed"], dry["reminders_resumed"]) == (False, True, 2)
        assert await pool.fetchval("SELECT count(*) FROM disabled_destinations") == 1
        async with http.post(enable, json={"apply": True}, headers=auth) as answer:
            assert answer.status == 400 and "say why" in (await answer.json())["error"]
        async with http.post(
            enable, json={"reason": "reopened", "apply": True}, headers=auth
        ) as answer:
            assert (await answer.json())["enabled"] is True
        assert await pool.fetchval("SELECT count(*) FROM disabled_destinations") == 0
        assert await pool.fetchval("SELECT count(*) FROM destinations WHERE state = 'enabled'") == 1


async def test_open_reads_let_pages_through_but_never_an_action(settings: Settings) -> None:
    async with cs.console(settings, open_reads=True) as c, cs.client() as http:
        await _page(http, f"{c.url}/runs")
        async with http.get(f"{c.url}/api/v1/dead") as answer:
            assert answer.status == 200
        async with http.post(f"{c.url}/api/v1/replay", json={"apply": True}) as answer:
            assert answer.status == 401


async def test_relay_console_refuses_to_start_without_a_token_and_stops_on_sigterm(
    settings: Settings, tmp_path: object
) -> None:
    refused = await rs.relay(settings, "console", CONSOLE_PORT="0")
    assert refused.code == 2 and "RELAY_CONSOLE_OPERATORS_FILE" in refused.stderr
    assert "relay console-operators add NAME" in refused.stderr
    plain = f"{tmp_path}/plain"
    with open(plain, "w") as f:
        f.write(f"alice:{cs.TOKEN}\n")  # a token where its hash belongs
    weak = await rs.relay(settings, "console", CONSOLE_PORT="0", CONSOLE_OPERATORS_FILE=plain)
    assert weak.code == 2 and "line 1: not a token hash" in weak.stderr
    assert cs.TOKEN not in weak.stderr and "relay console-operators add" in weak.stderr
    assert len(weak.stderr.strip().splitlines()) == 1
    operators_file = str(cs.operators_file())
    proc = await _start(settings, CONSOLE_PORT="0", CONSOLE_OPERATORS_FILE=operators_file)
    try:
        assert proc.stdout is not None
        first = (await proc.stdout.readline()).decode()
        url = re.search(r"http://127\.0\.0\.1:\d+/", first)
        assert url is not None, first
        async with cs.client() as http:
            csrf = await cs.log_in(http, url.group(0).rstrip("/"))
            assert csrf
    finally:
        code = await rs.stop(proc)
    assert code == 0


async def _start(settings: Settings, **env: str) -> forked.RelayProcess:
    return await forked.spawn(["console"], rs.env_for(settings, **env), stdout=forked.PIPE)


async def test_a_run_is_held_from_its_page_and_released_by_the_api_both_recorded(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line(f"clinic-{i}", partner.url("ok")) for i in range(3)])
    assert (await rs.relay(settings, "publish")).code == 0
    run_id = await pool.fetchval("SELECT max(run_id) FROM deliveries")
    async with cs.console(settings) as c, cs.client() as http:
        csrf = await cs.log_in(http, c.url, "carol")
        url = f"{c.url}/runs/{run_id}/action"
        async with http.post(url, data={"csrf": csrf, "action": "hold"}) as answer:
            assert answer.status == 200 and "Dry run: hold would touch 3" in await answer.text()
        assert await pool.fetchval("SELECT held_at FROM publish_runs WHERE id=$1", run_id) is None
        applied = {"csrf": csrf, "action": "hold", "apply": "1", "reason": "clinic asked"}
        async with http.post(url, data=applied) as answer:
            assert answer.status == 200 and "Hold: done" in await answer.text()
        runs_page = await _page(http, f"{c.url}/runs")
        assert '<span class="state retrying">held</span>' in runs_page
        run_page = await _page(http, f"{c.url}/runs/{run_id}")
        assert "carol (console)" in run_page and "clinic asked" in run_page
        async with http.post(url, data=applied | {"action": "explode"}) as answer:
            assert answer.status == 400
        auth = cs.bearer("dave")
        async with http.post(
            f"{c.url}/api/v1/runs/{run_id}/release",
            json={"apply": True, "reason": "all clear"},
            headers=auth,
        ) as answer:
            assert (await answer.json())["changed"] is True
    recorded = await pool.fetch("SELECT action, operator, reason FROM run_actions ORDER BY id")
    assert [tuple(r) for r in recorded] == [
        ("hold", "carol (console)", "clinic asked"),
        ("release", "dave (console)", "all clear"),
    ]
    assert await pool.fetchval("SELECT held_at FROM publish_runs WHERE id=$1", run_id) is None


async def test_the_dead_letter_queue_is_replayed_dry_run_first_and_drains(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    async with rs.consumer_in_process(settings):
        failed = await cs.run_with_failures(settings, pool, partner)
        async with cs.console(settings) as c, cs.client() as http:
            csrf = await cs.log_in(http, c.url)

            async def queue_depth() -> int:
                found = re.search(r'id="queue-depth">(\d+)<', await _page(http, f"{c.url}/dead"))
                assert found is not None
                return int(found.group(1))

            await rs.wait_for(lambda: _equals(queue_depth, 2), 20, "two dead letters in the queue")
            queue = {"csrf": csrf, "source": "queue"}
            async with http.post(f"{c.url}/replay", data=queue | {"run_id": "1"}) as answer:
                assert answer.status == 400  # the queue replay takes every dead letter
            async with http.post(f"{c.url}/replay", data=queue) as answer:
                assert "Would replay <strong>2</strong>" in await answer.text()
            assert await queue_depth() == 2  # a dry run leaves them there
            del partner.state.rules["bad"]
            applied = queue | {"apply": "1", "reason": "receiver fixed"}
            async with http.post(f"{c.url}/replay", data=applied) as answer:
                assert "Replayed <strong>2</strong>" in await answer.text()

            async def all_delivered() -> bool:
                return await rs.states(pool) == {"delivered": 5}

            await rs.wait_for(all_delivered, 30, "the replayed dead letters delivered")
            assert await queue_depth() == 0
    audit = await pool.fetchrow("SELECT source, operator, replayed FROM replays")
    assert tuple(audit) == ("dead-letter-queue", "alice (console)", 2)
    assert sorted(failed.dead) == sorted(
        await pool.fetchval("SELECT array_agg(id) FROM deliveries WHERE replays = 1")
    )


async def _equals(read: Callable[[], Awaitable[int]], expected: int) -> bool:
    return await read() == expected


async def test_more_replays_at_once_than_the_pool_has_connections_all_end_and_pages_answer(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    """Five applied replays posted at once while the test holds the ``replays`` table, so
    each waits on its first statement. An applied replay holds a pooled connection for its
    liveness lock: five at once on the console's pool of four took every connection and
    then waited for one of their own (before: a timeout failed them, HTTP 504, and pages
    waited too). Now they run one at a time, a page answers meanwhile, and all five end,
    recorded."""
    auth = cs.bearer("ops-bot")
    async with rs.consumer_in_process(settings):
        failed = await cs.run_with_failures(settings, pool, partner)
    # No consumer from here on: a replayed row stays queued, so exactly one replay finds
    # the two dead rows (with one running, they could die again before the next).
    async with cs.console(settings) as c, cs.client(headers=auth) as http:
        holder = await asyncpg.connect(settings.database_url.get_secret_value())
        try:
            held = holder.transaction()
            await held.start()
            await holder.execute("LOCK TABLE replays IN EXCLUSIVE MODE")

            async def replay() -> dict[str, int]:
                body = {"run_id": failed.run_id, "apply": True, "reason": "at once"}
                async with http.post(f"{c.url}/api/v1/replay", json=body) as answer:
                    assert answer.status == 200, await answer.text()
                    return cast(dict[str, int], await answer.json())

            replays = [asyncio.ensure_future(replay()) for _ in range(5)]

            await rs.wait_for(
                lambda: rs.waiting_on_a_lock(pool), 30, "a replay waiting on the table"
            )
            await asyncio.sleep(1.0)  # time for the others to take what they would take
            async with http.get(f"{c.url}/api/v1/runs") as answer:
                assert answer.status == 200
            await held.rollback()
            answers = await asyncio.wait_for(asyncio.gather(*replays), 60)
        finally:
            await holder.close()
    assert sorted(a["replayed"] for a in answers) == [0, 0, 0, 0, 2]
    ended = await pool.fetchval("SELECT count(*) FROM replays WHERE finished_at IS NOT NULL")
    assert ended == 5
