"""A database that asks for a password (scram-sha-256), on a throwaway PostgreSQL node.

The shared server trusts every local login, so nothing else tests a password. Here relay
logs in with the one in RELAY_DATABASE_URL, percent-encoded characters included, and a
wrong one is one line on stderr naming the server and the user (never the password),
exit 3, as the README's start-up failure table says.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import asyncpg
import pytest

from service import errors
from service.settings import Settings
from tests.support import relay as rs
from tests.support.nodes import PostgresNode, free_port, start_postgres

pytestmark = pytest.mark.fault

USER = "relay_login"
# Each of '@', '/', ':' and '?' would end a URL's password field: they are percent-encoded.
PASSWORD = "p@ss/w:rd?1"
DATABASE = "relay"


async def _create_login(node: PostgresNode) -> None:
    conn = await asyncpg.connect(node.url, timeout=10)
    try:
        await conn.execute(f"CREATE ROLE {USER} LOGIN PASSWORD '{PASSWORD}'")
        await conn.execute(f"CREATE DATABASE {DATABASE} OWNER {USER}")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


@pytest.fixture
def guarded_pg(tmp_path: Path) -> Iterator[PostgresNode]:
    """A node where USER must prove its password; ``postgres`` keeps its trusted login."""
    node = start_postgres(tmp_path, free_port())
    try:
        hba = node.dir / "data" / "pg_hba.conf"
        # The first matching line wins: this user's comes before the trust lines.
        hba.write_text(f"host all {USER} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
        asyncio.run(_create_login(node))  # also reloads pg_hba.conf
        yield node
    finally:
        node.cleanup()


def _url(node: PostgresNode, password: str) -> str:
    return f"postgresql://{USER}:{quote(password, safe='')}@127.0.0.1:{node.port}/{DATABASE}"


async def test_the_password_in_the_url_logs_in_percent_encoded_characters_included(
    settings: Settings, guarded_pg: PostgresNode
) -> None:
    url = _url(guarded_pg, PASSWORD)
    migrated = await rs.relay(settings, "migrate", DATABASE_URL=url)
    assert migrated.code == errors.ExitCode.OK, migrated.stderr
    status = await rs.relay(settings, "status", DATABASE_URL=url)
    assert status.code == errors.ExitCode.OK, status.stderr
    # The server really asked: the same login without a password is refused.
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(
            f"postgresql://{USER}@127.0.0.1:{guarded_pg.port}/{DATABASE}", timeout=10
        )


async def test_a_wrong_password_is_one_line_naming_the_user_exit_3(
    settings: Settings, guarded_pg: PostgresNode
) -> None:
    wrong = "n0t-the-password"
    result = await rs.relay(settings, "status", DATABASE_URL=_url(guarded_pg, wrong))
    assert result.code == errors.ExitCode.UNAVAILABLE
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    (line,) = lines
    assert line.startswith(f"relay: PostgreSQL at 127.0.0.1:{guarded_pg.port}, database "), line
    assert f"login refused for user '{USER}': wrong password" in line, line
    assert "RELAY_DATABASE_URL" in line
    assert wrong not in result.stderr and "Traceback" not in result.stderr
