"""PostgreSQL fails over to its standby under a drain (issue 19).

A throwaway primary and a streaming standby made from it (``pg_basebackup -R -X
stream``), replicating synchronously (``synchronous_standby_names = '*'``: every commit
the relay saw is on the standby, which is what a zero-loss failover needs). Every relay
process reaches them through one multi-host ``RELAY_DATABASE_URL``
(``postgresql://...@127.0.0.1:P1,127.0.0.1:P2/postgres``; the relay adds
``target_session_attrs=read-write``). A quarter of the way through a drain the primary is
SIGKILLed and the standby promoted. Then:

- every row is delivered within ``RELAY_LEASE_SECONDS`` + 30 s of the promotion;
- the partner saw exactly one logical event per key, and no dead letter was written;
- no consumer exited: the failover is an outage shorter than its bound, waited out;
- every SIGTERM ended with exit 0 within the grace bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from tests.support.fleet import Facts, drain_settings, eventually, start_drain
from tests.support.nodes import (
    NODES_BASE,
    PostgresNode,
    RabbitNode,
    _ensure_public_dir,
    free_port,
)
from tests.support.relay import RunningPartner

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

ROWS = 2000
BIN = Path("/usr/lib/postgresql/15/bin")


def _as_postgres(*args: str | Path, timeout: float = 120) -> None:
    cmd = ["runuser", "-u", "postgres", "--", *(str(a) for a in args)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd="/", stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stderr[-1500:]}"


def _start_standby(primary: PostgresNode) -> PostgresNode:
    """A streaming standby of ``primary`` on a port of its own, data under NODES_BASE."""
    _ensure_public_dir(NODES_BASE)
    owned = Path(tempfile.mkdtemp(prefix="pg-standby-", dir=NODES_BASE))
    shutil.chown(owned, "postgres", "postgres")
    standby = PostgresNode(dir=owned, port=free_port(), owned_dir=owned)
    try:
        _as_postgres(
            BIN / "pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
            "-D", owned / "data", "-R", "-X", "stream",
        )  # fmt: skip
        standby.start()
    except BaseException:
        standby.cleanup()
        raise
    return standby


async def _replicating_synchronously(primary: PostgresNode) -> None:
    conn = await asyncpg.connect(primary.url, timeout=10)
    try:
        await conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        await conn.execute("SELECT pg_reload_conf()")

        async def sync() -> bool:
            states = await conn.fetch("SELECT sync_state FROM pg_stat_replication")
            return [r["sync_state"] for r in states] == ["sync"]

        assert await eventually(sync, 30), "the standby never became synchronous"
    finally:
        await conn.close()


@pytest.fixture
def standby(pg: PostgresNode) -> Iterator[PostgresNode]:
    node = _start_standby(pg)
    try:
        yield node
    finally:
        with contextlib.suppress(Exception):
            node.cleanup()


async def test_primary_killed_and_standby_promoted_during_a_drain_loses_nothing(
    pg: PostgresNode,
    standby: PostgresNode,
    module_rabbit: RabbitNode,
    partner: RunningPartner,
    tmp_path: Path,
) -> None:
    await _replicating_synchronously(pg)
    hosts = f"127.0.0.1:{pg.port},127.0.0.1:{standby.port}"
    assert partner.state.verify_secret is not None
    settings = drain_settings(
        database_url=f"postgresql://postgres@{hosts}/postgres",
        amqp_url=module_rabbit.url,
        secret=partner.state.verify_secret,
        state_dir=tmp_path,
    )
    ledger_url = f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"
    async with start_drain(
        settings, partner, tmp_path / "logs", rows=ROWS, ledger_url=ledger_url, broker=module_rabbit
    ) as fleet:
        await fleet.wait_delivered(ROWS // 4, timeout=60)
        fleet.note(f"SIGKILL the primary (port {pg.port})")
        await asyncio.to_thread(pg.kill)
        await asyncio.to_thread(
            _as_postgres, BIN / "pg_ctl", "promote", "-w", "-D", standby.dir / "data"
        )
        promoted = fleet.note(f"standby promoted (port {standby.port})")

        facts = Facts(fleet)
        await fleet.expect_all_delivered(facts, within=settings.lease_seconds + 30, since=promoted)
        unrequested = fleet.unrequested_exits()
        facts.check(
            not unrequested,
            "a consumer exited during the failover: " + "; ".join(map(str, unrequested)),
        )
        await fleet.finish(facts)  # no dead letters, one event per key, SIGTERMs in bound
        facts.assert_all()
