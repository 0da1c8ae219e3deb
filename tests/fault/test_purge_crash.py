"""`relay purge` killed with SIGKILL at a named point, then run again: the ledger ends where
uninterrupted purges put the same history (a twin database seeded alike), and at no moment
is a delivery without the children it had (a batch is whole or not at all)."""

from __future__ import annotations

import signal
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from pydantic import SecretStr

from service import db
from service.settings import Settings
from tests.support import relay as rs
from tests.support import retention as history


@pytest.fixture
async def twin(settings: Settings, template_db: str) -> AsyncIterator[Settings]:
    """Settings for a second database of this test's, cloned from the same template."""
    base = settings.database_url.get_secret_value()
    name = f"relay_t_twin_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(base)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    finally:
        await admin.close()
    url = urlunsplit(urlsplit(base)._replace(path=f"/{name}"))
    yield settings.model_copy(update={"database_url": SecretStr(url)})
    admin = await asyncpg.connect(base)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


# What a purge leaves, without the times it writes (when content was purged, run records).
_STATE = {
    "deliveries": "SELECT id, state::text, run_id, destination, payload,"
    " content_purged_at IS NOT NULL AS purged FROM deliveries ORDER BY id",
    "delivery_attempts": "SELECT delivery_id, attempt, outcome, response_excerpt"
    " FROM delivery_attempts ORDER BY 1, 2",
    "receipts": "SELECT id, delivery_id FROM receipts ORDER BY id",
    "reconciliations": "SELECT id, delivery_id FROM reconciliations ORDER BY id",
    "events": "SELECT id, payload FROM events ORDER BY id",
    "publish_runs": "SELECT id, purged_counts FROM publish_runs ORDER BY id",
    "suppressions": "SELECT id, delivery_id FROM suppressions ORDER BY id",
    "audit": "SELECT (SELECT count(*) FROM run_actions),"
    " (SELECT count(*) FROM destination_actions),"
    " (SELECT count(*) FROM replays), (SELECT count(*) FROM console_reveals),"
    " (SELECT count(*) FROM console_sessions), (SELECT count(*) FROM admission_pauses)",
    "purge_totals": "SELECT table_name, kind, rows FROM purge_totals ORDER BY 1, 2",
}


async def _state(pool: asyncpg.Pool) -> dict[str, list[Any]]:
    return {name: [tuple(r) for r in await pool.fetch(sql)] for name, sql in _STATE.items()}


async def _children(pool: asyncpg.Pool) -> dict[int, tuple[int, int, int]]:
    """Per delivery: its attempts, receipts and reconciliations."""
    rows = await pool.fetch(
        "SELECT d.id,"
        " (SELECT count(*) FROM delivery_attempts AS a WHERE a.delivery_id = d.id),"
        " (SELECT count(*) FROM receipts AS r WHERE r.delivery_id = d.id),"
        " (SELECT count(*) FROM reconciliations AS c WHERE c.delivery_id = d.id)"
        " FROM deliveries AS d"
    )
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


async def _purge(settings: Settings, **env: str) -> rs.Result:
    return await rs.relay(settings, "purge", "--batch-size", "2", **env)


@pytest.mark.parametrize(
    ("point", "rows_gone"),
    [
        ("purge_inside_batch", 0),  # killed inside the first batch of rows: it rolls back
        ("purge_after_batch", 2),  # killed right after the first batch of rows committed
    ],
)
async def test_purge_killed_at_a_named_point_then_run_again_ends_where_an_uninterrupted_one_does(
    settings: Settings, pool: asyncpg.Pool, twin: Settings, point: str, rows_gone: int
) -> None:
    await history.seed(pool)
    twin_pool = await db.create_pool(twin, size=2)
    try:
        await history.seed(twin_pool)
        before = await history.counts(pool)
        children = await _children(pool)

        killed = await _purge(settings, CRASH_AT=point)
        assert killed.code == -signal.SIGKILL, killed.stderr
        # Every step before the rows ran whole; of the rows, whole batches only.
        after_kill = await history.counts(pool)
        assert before["deliveries"] - after_kill["deliveries"] == rows_gone
        # No delivery lost a child without going itself.
        kept = await _children(pool)
        assert kept == {i: children[i] for i in kept}
        totals = dict(
            ((r["table_name"], r["kind"]), r["rows"])
            for r in await pool.fetch("SELECT * FROM purge_totals")
        )
        assert totals.get(("deliveries", "rows"), 0) == rows_gone
        assert totals[("deliveries", "content")] == history.EXPECTED[0]["content"]["deliveries"]
        assert await pool.fetchval("SELECT status FROM purge_runs") == "running"

        # Run again until nothing is left to do, on both: the same ledger.
        for _ in range(2):
            assert (await _purge(settings)).code == 0
            assert (await _purge(twin)).code == 0
        assert await _state(pool) == await _state(twin_pool)
        statuses = [
            r["status"] for r in await pool.fetch("SELECT status FROM purge_runs ORDER BY id")
        ]
        assert statuses == ["interrupted", "ok", "ok"]
        last = await rs.relay(settings, "purge", "--dry-run", "--json")
        assert '"deliveries": 0' in last.stdout and last.code == 0
    finally:
        await twin_pool.close()
