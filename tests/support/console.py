"""Helpers for the console's tests: a console on a real port, a logged-in HTTP client,
and a ledger with failures (a run whose deliveries to one path were rejected)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import asyncpg

from service.ops import partner as partner_mod
from service.ops.console import run as console_run
from service.ops.console import security
from service.settings import Settings
from tests.support import relay as rs

TOKEN = "console-test-token-0123456789abcdef"
_CSRF = re.compile(r'name="csrf" value="([0-9a-f]+)"')


@dataclass
class Console:
    url: str
    port: int


@asynccontextmanager
async def console(settings: Settings, *, open_reads: bool = False) -> AsyncIterator[Console]:
    """``relay console``'s server (its composition root) on a free loopback port."""
    door = security.Door(TOKEN, open_reads=open_reads)
    local = settings.model_copy(update={"console_port": 0, "console_host": "127.0.0.1"})
    async with console_run.serving(local, door) as (_, port):
        yield Console(f"http://127.0.0.1:{port}", port)


def client(**kwargs: object) -> aiohttp.ClientSession:
    """An HTTP client that keeps cookies from 127.0.0.1 (aiohttp's default jar refuses
    cookies from IP addresses)."""
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True), **kwargs)  # type: ignore[arg-type]


async def log_in(http: aiohttp.ClientSession, base: str, name: str = "alice") -> str:
    """Log in with the token; the session's CSRF token (read from a page's form)."""
    async with http.post(
        f"{base}/login", data={"name": name, "token": TOKEN}, allow_redirects=False
    ) as answer:
        assert answer.status == 303, await answer.text()
    async with http.get(f"{base}/runs") as page:
        assert page.status == 200
        found = _CSRF.search(await page.text())
    assert found is not None
    return found.group(1)


@dataclass
class Failures:
    run_id: int
    delivered: list[int]
    dead: list[int]


async def run_with_failures(
    settings: Settings, pool: asyncpg.Pool, partner: rs.RunningPartner, ok: int = 3, bad: int = 2
) -> Failures:
    """Load ``ok`` reminders to a path that accepts and ``bad`` to one that answers 400,
    publish them (one run) and wait until the consumer (started by the caller) has
    delivered the first and dead-lettered the second."""
    partner.state.rules["bad"] = partner_mod.PathRule(status=400)
    lines = [rs.line(f"clinic-{i}-daily", partner.url("ok")) for i in range(ok)]
    lines += [rs.line(f"clinic-bad-{i}", partner.url("bad")) for i in range(bad)]
    await rs.load(pool, lines)
    published = await rs.relay(settings, "publish")
    assert published.code == 0, published.stderr

    async def final() -> bool:
        states = await rs.states(pool)
        return states.get("delivered", 0) == ok and states.get("dead", 0) == bad

    await rs.wait_for(final, 60, "the run's deliveries to be final")
    rows = await pool.fetch("SELECT id, state::text AS state, run_id FROM deliveries ORDER BY id")
    return Failures(
        run_id=rows[0]["run_id"],
        delivered=[r["id"] for r in rows if r["state"] == "delivered"],
        dead=[r["id"] for r in rows if r["state"] == "dead"],
    )
