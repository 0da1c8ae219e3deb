"""What the erasure tests share: searching every text column of the ledger for an
address, a dump of every row (what "nothing changed" compares), `relay erase` run as a
process, and a partner that echoes what it receives."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from aiohttp import web
from cryptography.fernet import Fernet
from pydantic import SecretStr

from service import outbox
from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import relay as rs


async def columns(pool: asyncpg.Pool) -> list[tuple[str, str]]:
    """Every text, varchar and jsonb column of every table and view in the public schema."""
    rows = await pool.fetch(
        "SELECT table_name, column_name FROM information_schema.columns"
        " WHERE table_schema = 'public'"
        " AND data_type IN ('text', 'character varying', 'character', 'jsonb', 'json')"
        " ORDER BY 1, 2"
    )
    return [(r["table_name"], r["column_name"]) for r in rows]


async def hits(pool: asyncpg.Pool, needles: list[str]) -> dict[str, int]:
    """``table.column`` -> rows whose value (jsonb as text) holds any needle, any case."""
    found: dict[str, int] = {}
    for table, column in await columns(pool):
        n = await pool.fetchval(
            f'SELECT count(*) FROM "{table}" WHERE EXISTS (SELECT 1 FROM unnest($1::text[])'
            f' AS x WHERE strpos(lower("{column}"::text), lower(x)) > 0)',
            needles,
        )
        if n:
            found[f"{table}.{column}"] = n
    return found


async def dump(pool: asyncpg.Pool) -> dict[str, list[str]]:
    """Every row of every table, as text: what "nothing changed" compares."""
    tables = await pool.fetch(
        "SELECT table_name FROM information_schema.tables"
        " WHERE table_schema = 'public' AND table_type = 'BASE TABLE' ORDER BY 1"
    )
    dump = {}
    for t in tables:
        name = t["table_name"]
        dump[name] = sorted(r[0] for r in await pool.fetch(f'SELECT t::text FROM "{name}" t'))
    return dump


def holding(dump: dict[str, list[str]], needle: str) -> dict[str, list[str]]:
    return {t: [r for r in rows if needle.lower() in r.lower()] for t, rows in dump.items()}


async def erase(settings: Settings, *args: str, code: int = 0) -> dict[str, Any]:
    result = await rs.relay(settings, "erase", *args, "--json", "--operator", "alice")
    assert result.code == code, result.stderr
    return json.loads(result.stdout) if code == 0 else {"stderr": result.stderr}


async def ok(settings: Settings, *args: str) -> str:
    result = await rs.relay(settings, *args)
    assert result.code == 0, result.stderr
    return result.stdout


@pytest.fixture
async def echo() -> AsyncIterator[str]:
    """A partner that answers each request with the body it received (its reply, kept as
    the attempt's excerpt, then quotes whatever the payload named)."""

    async def handle(request: web.Request) -> web.Response:
        return web.json_response({"echo": json.loads(await request.read())})

    app = web.Application()
    app.router.add_post("/hooks/{name}", handle)
    runner, port = await partner_mod.serve(app)
    yield f"http://127.0.0.1:{port}/hooks/partner"
    await runner.cleanup()


def keyed(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"destination_secrets_keys": [SecretStr(Fernet.generate_key().decode())]}
    )


def email(reminder_id: str, address: str, text: str) -> str:
    payload = {"subject": "Your report", "text": text}
    return rs.line(reminder_id, address, channel="email", payload=payload)


async def until(pool: asyncpg.Pool, sql: str, expected: Any, what: str) -> None:
    async def done() -> bool:
        return bool(await pool.fetchval(sql) == expected)

    await rs.wait_for(done, 60, what)


async def intent(pool: asyncpg.Pool, key: str, channel: str, to: str, **payload: Any) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await outbox.add_intent(
            conn,
            key=key,
            channel=channel,
            destination=to,
            payload=payload,  # type: ignore[arg-type]
        )
