"""Who may use the console, over real HTTP against real PostgreSQL: failed logins are
logged (address, no token), counted in /metrics and, five a minute, answered 429 with
Retry-After even for the right token; sessions live in the database, so logging out
kills a copied cookie at once, and they end after 30 idle minutes or 12 hours; over HTTPS
the cookie is ``__Host-``-prefixed and Secure; each operator has a token of their own and
removing one from the file revokes them (token and sessions) without touching the others.
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import asyncpg
import pytest

from service.settings import Settings
from tests.support import console as cs
from tests.support import relay as rs


class SettableClock:
    def __init__(self) -> None:
        self.at = datetime(2030, 1, 7, 6, 0, tzinfo=UTC)

    def now(self) -> datetime:
        return self.at


async def _status(http: aiohttp.ClientSession, url: str, **kwargs: object) -> int:
    async with http.get(url, allow_redirects=False, **kwargs) as answer:  # type: ignore[arg-type]
        return answer.status


async def _log_in_cookie(base: str, name: str, token: str) -> tuple[int, aiohttp.ClientResponse]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{base}/login", data={"name": name, "token": token}, allow_redirects=False
        ) as answer,
    ):
        await answer.read()
        return answer.status, answer


def _cookie(answer: aiohttp.ClientResponse, name: str = "relay_console") -> str:
    found = re.search(rf"{re.escape(name)}=([^;]+)", answer.headers.get("Set-Cookie", ""))
    assert found is not None, answer.headers.get("Set-Cookie")
    return found.group(1)


async def _failures(http: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with http.get(f"{base}/metrics") as answer:
        text = await answer.text()
    return {
        reason: float(value)
        for reason, value in re.findall(
            r'relay_console_login_failures_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)', text
        )
    }


async def test_failed_logins_are_logged_counted_and_five_a_minute_block_the_address(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="relay.console")
    wrong = "alice-wrong-token-0123456789abcdefghijkl"
    async with cs.console(settings) as c, cs.client() as http:
        for attempt in range(5):
            form = {"name": "alice" if attempt < 4 else "not-an-operator", "token": wrong}
            async with http.post(f"{c.url}/login", data=form, allow_redirects=False) as answer:
                assert answer.status == 401 and "Set-Cookie" not in answer.headers
        assert await _failures(http, c.url) == {"wrong_token": 5}
        # Blocked: even the right token is not checked, and the API's bearer neither.
        right = {"name": "alice", "token": cs.TOKENS["alice"]}
        async with http.post(f"{c.url}/login", data=right, allow_redirects=False) as answer:
            assert answer.status == 429 and "Set-Cookie" not in answer.headers
            assert 0 < int(answer.headers["Retry-After"]) <= 60
        async with http.get(f"{c.url}/api/v1/runs", headers=cs.bearer("bob")) as answer:
            assert answer.status == 429 and int(answer.headers["Retry-After"]) <= 60
        assert await _failures(http, c.url) == {"wrong_token": 5, "throttled": 2}
    lines = [r for r in caplog.records if getattr(r, "event", "") == "console_login_failed"]
    assert len(lines) == 5
    assert all(r.remote == "127.0.0.1" and r.levelname == "WARNING" for r in lines)  # type: ignore[attr-defined]
    assert [getattr(r, "operator", None) for r in lines] == ["alice"] * 4 + [None]
    blocked = [r for r in caplog.records if getattr(r, "event", "") == "console_login_blocked"]
    assert [r.seconds for r in blocked] == [60]  # type: ignore[attr-defined]
    for record in caplog.records:  # no token, right or wrong, in any line
        text = str(record.__dict__)
        assert wrong not in text and cs.TOKENS["alice"] not in text


async def test_a_wrong_bearer_token_is_a_failed_login_too(settings: Settings) -> None:
    async with cs.console(settings) as c, cs.client() as http:
        bad = {"Authorization": f"Bearer {cs.TOKENS['bob']}", "X-Relay-Operator": "alice"}
        async with http.get(f"{c.url}/api/v1/runs", headers=bad) as answer:
            assert answer.status == 401  # bob's token is not alice's
        async with http.get(f"{c.url}/api/v1/runs", headers=cs.bearer("bob")) as answer:
            assert answer.status == 200
        assert await _failures(http, c.url) == {"wrong_token": 1}


async def test_logging_out_revokes_the_session_so_a_copied_cookie_stops_working(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    async with cs.console(settings) as c:
        status, answer = await _log_in_cookie(c.url, "alice", cs.TOKENS["alice"])
        assert status == 303
        cookie = _cookie(answer)
        stolen = {"Cookie": f"relay_console={cookie}"}
        async with aiohttp.ClientSession() as thief:
            assert await _status(thief, f"{c.url}/runs", headers=stolen) == 200
        async with cs.client() as http:
            csrf = await cs.log_in(http, c.url)  # a second session of alice's
            async with http.post(f"{c.url}/logout", data={"csrf": csrf}) as out:
                assert out.status == 200 and out.url.path == "/login"
            assert await _status(http, f"{c.url}/runs") == 303  # this one ended
        async with aiohttp.ClientSession() as thief:
            assert await _status(thief, f"{c.url}/runs", headers=stolen) == 200  # not that one
            async with thief.post(
                f"{c.url}/logout", data={"csrf": await _csrf(thief, c.url, stolen)}, headers=stolen
            ) as out:
                assert out.status in (200, 303)
            assert await _status(thief, f"{c.url}/runs", headers=stolen) == 303
            assert await _status(thief, f"{c.url}/api/v1/runs", headers=stolen) == 401
    rows = await pool.fetch("SELECT operator, revoked_why FROM console_sessions ORDER BY id")
    assert [tuple(r) for r in rows] == [("alice", "logout"), ("alice", "logout")]
    # The table holds the cookie's hash, never the cookie.
    stored = "SELECT count(*) FROM console_sessions WHERE id_hash = sha256(convert_to($1, 'UTF8'))"
    assert await pool.fetchval(stored, cookie) == 1


async def _csrf(http: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> str:
    async with http.get(f"{base}/runs", headers=headers) as page:
        found = re.search(r'name="csrf" value="([^"]+)"', await page.text())
    assert found is not None
    return found.group(1)


async def test_a_session_ends_after_30_idle_minutes_and_after_12_hours_however_used(
    settings: Settings,
) -> None:
    clock = SettableClock()
    async with cs.console(settings, clock=clock) as c, aiohttp.ClientSession() as http:
        # Used every 20 minutes, a session still ends 12 hours after its log-in.
        _, answer = await _log_in_cookie(c.url, "carol", cs.TOKENS["carol"])
        busy = {"Cookie": f"relay_console={_cookie(answer)}"}
        started = clock.at
        while clock.at + timedelta(minutes=20) < started + timedelta(hours=12):
            clock.at += timedelta(minutes=20)
            assert await _status(http, f"{c.url}/runs", headers=busy) == 200, clock.at
        clock.at = started + timedelta(hours=12, seconds=1)
        assert await _status(http, f"{c.url}/runs", headers=busy) == 303
        # Unused for more than 30 minutes, a session ends; each use starts the 30 again.
        _, answer = await _log_in_cookie(c.url, "carol", cs.TOKENS["carol"])
        idle = {"Cookie": f"relay_console={_cookie(answer)}"}
        clock.at += timedelta(minutes=29)
        assert await _status(http, f"{c.url}/runs", headers=idle) == 200
        clock.at += timedelta(minutes=29)  # 58 minutes after the log-in, 29 after its use
        assert await _status(http, f"{c.url}/runs", headers=idle) == 200
        clock.at += timedelta(minutes=31)
        assert await _status(http, f"{c.url}/runs", headers=idle) == 303


async def test_over_https_the_cookie_is_host_prefixed_and_secure(settings: Settings) -> None:
    async with cs.console(settings, console_https=True) as c:
        status, answer = await _log_in_cookie(c.url, "dave", cs.TOKENS["dave"])
        assert status == 303
        set_cookie = answer.headers["Set-Cookie"]
        assert set_cookie.startswith("__Host-relay_console=")
        attributes = {a.strip().split("=")[0].lower() for a in set_cookie.split(";")[1:]}
        assert {"secure", "httponly", "samesite", "path"} <= attributes
        assert "domain" not in attributes and "Path=/" in set_cookie
        assert "max-age=43200" in set_cookie.lower()  # 12 hours
        assert answer.headers["Strict-Transport-Security"].startswith("max-age=")
        cookie = {"Cookie": f"__Host-relay_console={_cookie(answer, '__Host-relay_console')}"}
        async with aiohttp.ClientSession() as http:
            assert await _status(http, f"{c.url}/runs", headers=cookie) == 200
            plain = {"Cookie": cookie["Cookie"].removeprefix("__Host-")}
            assert await _status(http, f"{c.url}/runs", headers=plain) == 303


async def test_removing_an_operator_revokes_their_token_and_sessions_but_no_one_elses(
    settings: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    path = cs.write_operators(tmp_path / "operators", ("alice", "bob"))
    file = ("--file", str(path))
    async with cs.console(settings, operators_path=path) as c, aiohttp.ClientSession() as http:
        _, answer = await _log_in_cookie(c.url, "alice", cs.TOKENS["alice"])
        alice = {"Cookie": f"relay_console={_cookie(answer)}"}
        _, answer = await _log_in_cookie(c.url, "bob", cs.TOKENS["bob"])
        bob = {"Cookie": f"relay_console={_cookie(answer)}"}
        status, _ = await _log_in_cookie(c.url, "carol", cs.TOKENS["carol"])
        assert status == 401  # not in this file
        assert await _status(http, f"{c.url}/api/v1/runs", headers=cs.bearer("alice")) == 200

        removed = await rs.relay(settings, "console-operators", "remove", "alice", *file)
        assert removed.code == 0, removed.stderr
        # The running console rereads the file: alice is out, bob is not touched.
        assert await _status(http, f"{c.url}/runs", headers=alice) == 303
        assert await _status(http, f"{c.url}/api/v1/runs", headers=cs.bearer("alice")) == 401
        assert await _status(http, f"{c.url}/runs", headers=bob) == 200
        assert await _status(http, f"{c.url}/api/v1/runs", headers=cs.bearer("bob")) == 200

        added = await rs.relay(settings, "console-operators", "add", "alice", *file)
        assert added.code == 0, added.stderr
        token = added.stdout.strip()
        assert len(token) >= 32 and token not in path.read_text()
        listed = await rs.relay(settings, "console-operators", "list", *file)
        assert listed.stdout.split() == ["bob", "alice"]
        # alice is back with a new token: her old token and her old session stay dead.
        assert await _status(http, f"{c.url}/runs", headers=alice) == 303
        assert await _status(http, f"{c.url}/api/v1/runs", headers=cs.bearer("alice")) == 401
        new = {"Authorization": f"Bearer {token}", "X-Relay-Operator": "alice"}
        assert await _status(http, f"{c.url}/api/v1/runs", headers=new) == 200
        assert await _status(http, f"{c.url}/runs", headers=bob) == 200

        # A file broken by an edit lets nobody in (fail closed) until it is fixed.
        good = path.read_text()
        path.write_text(good + "carol:her-token-pasted-here-0123456789abcdef\n")
        assert await _status(http, f"{c.url}/runs", headers=bob) == 303
        assert await _status(http, f"{c.url}/api/v1/runs", headers=new) == 401
        path.write_text(good)
        assert await _status(http, f"{c.url}/api/v1/runs", headers=new) == 200
    revoked = await pool.fetch(
        "SELECT operator, revoked_why FROM console_sessions WHERE revoked_at IS NOT NULL"
        " ORDER BY id"
    )
    assert [tuple(r) for r in revoked] == [("alice", "operator_gone"), ("bob", "operator_gone")]
