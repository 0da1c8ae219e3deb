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
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from tests.support.fleet import Facts, drain_settings, eventually, start_drain
from tests.support.nodes import PostgresNode, RabbitNode
from tests.support.relay import RunningPartner
from tests.support.replication import promote, start_standby

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

ROWS = 2000


async def _replicating_synchronously(primary: PostgresNode) -> None:
    conn = await asyncpg.connect(primary.url, timeout=10)
    try:
        await conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        await conn.execute("SELECT pg_reload_conf()")

        async def sync() -> bool:
            states = await conn.fetch("SELECT sync_state FROM pg_stat_replication")
            return [r["sync_state"] for r in states] == ["sync"]

        assert await eventually(sync, 60), "the standby never became synchronous"
    finally:
        await conn.close()


@pytest.fixture
def standby(pg: PostgresNode) -> Iterator[PostgresNode]:
    node = start_standby(pg)  # returned streaming from pg
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
        await asyncio.to_thread(promote, standby)
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
