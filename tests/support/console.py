"""Helpers for the console's tests: an operators file, a console on a real port, a
logged-in HTTP client, and a ledger with failures (a run whose deliveries to one path were
rejected, an event whose one delivery was)."""

from __future__ import annotations

import functools
import re
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from aiohttp import web

from service import outbox
from service.clock import Clock
from service.ops import partner as partner_mod
from service.ops.console import operators, refs
from service.ops.console import run as console_run
from service.settings import Settings
from tests.support import relay as rs

# Each test operator's own token (32+ characters, as the console demands).
NAMES = ("alice", "bob", "carol", "dave", "erin", "ops-bot")
TOKENS = {name: f"{name}-console-test-token-0123456789abcdef" for name in NAMES}
TOKEN = TOKENS["alice"]
CHEAP = (2**14, 8, 1)  # the cheapest scrypt the console accepts: tests hash many times
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def write_operators(path: Path, names: tuple[str, ...] = NAMES) -> Path:
    """An operators file with ``names`` and their ``TOKENS``."""
    lines = [operators.hash_line(name, TOKENS[name], CHEAP) for name in names]
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


@functools.cache
def operators_file() -> Path:
    """The operators file every test console shares (made once per process)."""
    folder = Path(tempfile.mkdtemp(prefix="relay-console-operators-"))
    return write_operators(folder / "operators")


def bearer(name: str = "alice") -> dict[str, str]:
    """The headers of a script acting as ``name``."""
    return {"Authorization": f"Bearer {TOKENS[name]}", "X-Relay-Operator": name}


async def ref_of(pool: asyncpg.Pool, destination: str) -> str:
    """The console's reference of ``destination`` (keyed by this database's secret)."""
    return (await refs.load(pool)).of(destination)


@dataclass
class Console:
    url: str
    port: int


@asynccontextmanager
async def console(
    settings: Settings,
    *,
    open_reads: bool = False,
    operators_path: Path | None = None,
    clock: Clock | None = None,
    **updates: Any,
) -> AsyncIterator[Console]:
    """``relay console``'s server (its composition root) on a free loopback port."""
    local = settings.model_copy(
        update={"console_port": 0, "console_host": "127.0.0.1", "console_open_reads": open_reads}
        | updates
    )
    known = operators.Operators(operators_path or operators_file())
    async with console_run.serving(local, known, clock) as (_, port):
        yield Console(f"http://127.0.0.1:{port}", port)


def client(**kwargs: object) -> aiohttp.ClientSession:
    """An HTTP client that keeps cookies from 127.0.0.1 (aiohttp's default jar refuses
    cookies from IP addresses)."""
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True), **kwargs)  # type: ignore[arg-type]


async def log_in(http: aiohttp.ClientSession, base: str, name: str = "alice") -> str:
    """Log in as ``name`` with their token; the session's CSRF token (read from a page)."""
    async with http.post(
        f"{base}/login", data={"name": name, "token": TOKENS[name]}, allow_redirects=False
    ) as answer:
        assert answer.status == 303, await answer.text()
    async with http.get(f"{base}/runs") as page:
        assert page.status == 200
        found = _CSRF.search(await page.text())
    assert found is not None
    return found.group(1)


@asynccontextmanager
async def answering(body: str, status: int = 400) -> AsyncIterator[str]:
    """A receiver on a free loopback port that answers every POST with ``status`` and
    ``body`` (as text/plain); yields its base URL."""

    async def answer(_: web.Request) -> web.Response:
        return web.Response(text=body, status=status)

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    runner, port = await partner_mod.serve(app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def dead_delivery(
    settings: Settings, pool: asyncpg.Pool, reminder_id: str, destination: str, **fields: Any
) -> int:
    """Load one reminder to ``destination``, publish it and wait (a consumer started by the
    caller) until its delivery is dead; its id."""
    await rs.load(pool, [rs.line(reminder_id, destination, **fields)])
    published = await rs.relay(settings, "publish")
    assert published.code == 0, published.stderr
    sql = "SELECT id FROM deliveries WHERE reminder_id = $1 AND state = 'dead'"

    async def dead() -> bool:
        return await pool.fetchval(sql, reminder_id) is not None

    await rs.wait_for(dead, 60, f"the delivery of {reminder_id} to be dead")
    return int(await pool.fetchval(sql, reminder_id))


@dataclass
class DeadEvent:
    event_id: int
    delivery_id: int


async def dead_event(
    settings: Settings, pool: asyncpg.Pool, key: str, destination: str, payload: dict[str, Any]
) -> DeadEvent:
    """Record one event (type ``console.test``) that ``destination`` alone subscribes to,
    publish its delivery and wait (a consumer started by the caller) until it is dead."""
    for args in (
        ("event-types", "add", "console.test"),
        ("destinations", "add", destination),
        ("destinations", "subscribe", destination, "console.test"),
    ):
        done = await rs.relay(settings, *args)
        assert done.code == 0, done.stderr
    async with pool.acquire() as conn, conn.transaction():
        recorded = await outbox.add_event(conn, key=key, event_type="console.test", payload=payload)
    assert recorded is not None and recorded.deliveries == 1
    published = await rs.relay(settings, "publish")
    assert published.code == 0, published.stderr
    sql = "SELECT id FROM deliveries WHERE event_id = $1 AND state = 'dead'"

    async def dead() -> bool:
        return await pool.fetchval(sql, recorded.event_id) is not None

    await rs.wait_for(dead, 60, f"the delivery of event {key} to be dead")
    return DeadEvent(recorded.event_id, int(await pool.fetchval(sql, recorded.event_id)))


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
