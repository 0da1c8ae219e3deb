"""The database boundary: the named SQL blocks, the connection pool, and migrations.

SQL lives in ``sql/queries.sql`` (named blocks) and ``sql/migrations/NNNN_*.sql``; this
module loads them once and hands out a pool whose connections decode jsonb to Python.

Opening the pool is where a misconfigured or missing database is found: every failure is
one ``UnavailableError`` (exit 3) whose message names the server (host:port and database,
never the DSN), the setting and the cause, and a pool is handed out only when the
database's schema has every migration this code ships (else: "run `relay migrate`").
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import ssl as ssl_module
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import asyncpg

from service import errors, servers
from service.settings import Settings

_MIGRATION_TIMEOUT_SECONDS = 24 * 3600.0
_BLOCK = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@functools.cache
def queries() -> dict[str, str]:
    """Every named SQL block, loaded once from service/sql/queries.sql."""
    text = resources.files("service").joinpath("sql/queries.sql").read_text("utf-8")
    parts = _BLOCK.split(text)
    blocks: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        blocks[name] = body.strip().rstrip(";").strip()
    return blocks


def q(name: str) -> str:
    """One named SQL block."""
    return queries()[name]


@functools.cache
def migration_versions() -> tuple[str, ...]:
    """The version (file name without .sql) of every packaged migration, in order."""
    return tuple(version for version, _ in migrations())


def migrations() -> list[tuple[str, str]]:
    """(version, sql) of every migration, in order."""
    folder = resources.files("service").joinpath("sql/migrations")
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)
    return [(f.name.removesuffix(".sql"), f.read_text("utf-8")) for f in files]


async def _init_connection(conn: asyncpg.Connection) -> None:
    for kind in ("json", "jsonb"):
        await conn.set_type_codec(kind, encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _no_session_state(conn: asyncpg.Connection) -> None:
    """Pool release hook. The relay never changes session state (no SET, LISTEN, prepared
    names of its own, temp tables), so the default RESET ALL round trip is skipped;
    asyncpg still rolls back an open transaction and clears listeners itself."""


def _ssl_arg(mode: str, root_cert: Path | None) -> Any:
    if mode in ("verify-ca", "verify-full"):
        context = ssl_module.create_default_context(cafile=root_cert)
        context.check_hostname = mode == "verify-full"
        return context
    return mode


# Errors that say the database cannot answer now (down, restarting, hung past the
# statement deadline, out of connections, a standby after a failover), as opposed to an
# error in what was asked. The consumer waits these out instead of failing deliveries.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,  # shutdown, cannot connect now, timeout
    asyncpg.exceptions.InsufficientResourcesError,  # too many connections
    asyncpg.exceptions.ReadOnlySQLTransactionError,  # connected to a standby
    asyncpg.TargetServerAttributeNotMatched,  # every host a standby: failover under way
)
_CANNOT_OPEN: tuple[type[BaseException], ...] = (
    *_UNAVAILABLE,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)
# Two transactions that locked the same rows in another order: run it again.
CONFLICT: tuple[type[BaseException], ...] = (asyncpg.exceptions.TransactionRollbackError,)


def is_unavailable(exc: BaseException) -> bool:
    """True if ``exc`` means the database cannot answer now (rather than a bad request)."""
    if isinstance(exc, asyncpg.InterfaceError):
        # The connection went away under the call; other interface errors are bugs.
        return "closed" in str(exc) or "lost" in str(exc)
    if isinstance(exc, asyncpg.InternalClientError):
        # A server killed under a busy connection can leave its protocol mid-operation:
        # the next statement on it fails so ("cannot switch to state ...; another
        # operation is in progress") before asyncpg notices the connection is gone.
        return "another operation" in str(exc)
    return isinstance(exc, _UNAVAILABLE)


def _session_attrs(dsn: str) -> Any:
    """``read-write`` unless the DSN (``target_session_attrs``) or PGTARGETSESSIONATTRS
    says otherwise: the relay writes, so with several hosts a connection must reach the
    primary (after a failover, the promoted standby), never a standby."""
    if "target_session_attrs" in parse_qs(urlsplit(dsn).query):
        return None
    return None if os.environ.get("PGTARGETSESSIONATTRS") else "read-write"


async def create_pool(
    settings: Settings, *, size: int | None = None, check_schema: bool = True
) -> asyncpg.Pool:
    """Open the pool; raise UnavailableError naming the server and the cause if the
    database cannot be used: unreachable, login refused, no such database, or (with
    ``check_schema``, every command but ``relay migrate``) a schema behind this code.

    Every statement has a deadline (``database_command_timeout_seconds``), enforced by the
    client and, as ``statement_timeout``, by the server, so a database that stops
    answering surfaces as an error within seconds instead of a silent hang.
    """
    pool_size = size or settings.database_pool_size
    deadline = settings.database_command_timeout_seconds
    try:
        pool = await asyncpg.create_pool(
            settings.database_url.get_secret_value(),
            min_size=min(2, pool_size),
            max_size=pool_size,
            init=_init_connection,
            reset=_no_session_state,
            ssl=_ssl_arg(settings.database_ssl, settings.database_ssl_root_cert),
            timeout=deadline,
            command_timeout=deadline,
            server_settings={"statement_timeout": str(round(deadline * 1000))},
            target_session_attrs=_session_attrs(settings.database_url.get_secret_value()),
            statement_cache_size=settings.database_statement_cache_size,
        )
    except _CANNOT_OPEN as exc:
        raise errors.UnavailableError(servers.database_unreachable(exc, settings)) from exc
    except ValueError as exc:  # the driver refused a DSN the settings let through
        raise errors.ConfigError(
            f"RELAY_DATABASE_URL: not a DSN the driver accepts ({type(exc).__name__})"
        ) from None
    assert pool is not None
    if check_schema:
        try:
            problem = await schema_problem(pool)
        except BaseException:
            pool.terminate()
            raise
        if problem is not None:
            await close_pool(pool, deadline)
            raise errors.UnavailableError(servers.database_where(settings, problem))
    return pool


async def schema_problem(executor: asyncpg.Pool | asyncpg.Connection) -> str | None:
    """Why the database's schema does not fit this code, or None: no relay schema at all,
    or migrations this code ships that were not applied. (A schema ahead of the code, from
    a newer release during a rolling upgrade, is fine: migrations only add.)"""
    if not await executor.fetchval(q("migrations_present")):
        return "no relay schema in this database: run `relay migrate`"
    applied = {r["version"] for r in await executor.fetch(q("migrations_applied"))}
    missing = [v for v in migration_versions() if v not in applied]
    if missing:
        return (
            f"the schema is behind this relay ({len(missing)} migration(s) not applied, "
            f"from {missing[0]}): run `relay migrate`"
        )
    return None


async def close_pool(pool: asyncpg.Pool, timeout_seconds: float) -> None:
    """Close gracefully within the deadline, else drop every connection."""
    try:
        async with asyncio.timeout(timeout_seconds):
            await pool.close()
    except TimeoutError:
        pool.terminate()


async def migrate(pool: asyncpg.Pool) -> list[str]:
    """Apply pending migrations, each in its own transaction; return those applied.

    An advisory lock serialises concurrent runs, so two ``relay migrate`` at once are safe.
    """
    applied_now: list[str] = []
    async with pool.acquire() as conn:
        for version, sql in migrations():
            async with conn.transaction():
                await conn.execute(q("migrations_lock"))
                await conn.execute(q("migrations_table"))
                done = {r["version"] for r in await conn.fetch(q("migrations_applied"))}
                if version in done:
                    continue
                # A migration may take long on a big table: no statement deadline here.
                await conn.execute(q("migrations_no_deadline"))
                await conn.execute(sql, timeout=_MIGRATION_TIMEOUT_SECONDS)
                await conn.execute(q("migrations_record"), version)
                applied_now.append(version)
    return applied_now
