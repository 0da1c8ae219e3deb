"""Retention: `relay purge` against a real ledger with a history of every kind
(tests/support/retention.py: deliveries final and open, old and new, with attempts, receipts,
reconciliations, suppressions, events, runs and the audit trail), under the README's default
policy."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from service.settings import Settings
from tests.support import relay as rs
from tests.support import retention as history


async def _purge(settings: Settings, *args: str) -> dict[str, Any]:
    result = await rs.relay(settings, "purge", "--json", *args)
    assert result.code == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {table: n for table, n in counts.items() if n}


async def _rows(pool: asyncpg.Pool, ids: list[int]) -> list[Any]:
    """Every column of these deliveries and of their attempts, receipts, reconciliations."""
    found = []
    for table, column in (
        ("deliveries", "id"),
        ("delivery_attempts", "delivery_id"),
        ("receipts", "delivery_id"),
        ("reconciliations", "delivery_id"),
    ):
        rows = await pool.fetch(f"SELECT * FROM {table} WHERE {column} = ANY($1) ORDER BY 1", ids)
        found.append([dict(r) for r in rows])
    return found


async def test_purge_removes_exactly_what_the_policy_no_longer_keeps_and_never_an_open_row(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    seeded = await history.seed(pool)
    open_ids = [seeded.deliveries[label] for label in history.OPEN]
    open_before = await _rows(pool, open_ids)
    before = await history.counts(pool)

    dry = await _purge(settings, "--dry-run")
    assert await history.counts(pool) == before  # the dry run changed nothing
    first = await _purge(settings)
    second = await _purge(settings)
    third = await _purge(settings)

    expected_first, expected_second = history.EXPECTED
    for found in (dry, first):
        assert _nonzero(found["content"]) == expected_first["content"]
        assert _nonzero(found["rows"]) == _nonzero(expected_first["rows"])
        assert found["deliveries_by_channel"] == expected_first["deliveries_by_channel"]
    assert (dry["dry_run"], dry["purge_run_id"], first["status"]) == (True, None, "ok")
    # Events and runs whose last delivery went in the first run go in the second.
    assert _nonzero(second["content"]) == expected_second["content"]
    assert _nonzero(second["rows"]) == expected_second["rows"]
    assert _nonzero(third["content"]) == {} and _nonzero(third["rows"]) == {}

    after = await history.counts(pool)
    gone = {t: before[t] - after[t] for t in before}
    rows_first, rows_second = expected_first["rows"], expected_second["rows"]
    assert _nonzero(gone) == _nonzero(
        {t: rows_first.get(t, 0) + rows_second.get(t, 0) for t in before}
    )
    # Open rows are exactly as they were, column by column, with their attempts.
    assert await _rows(pool, open_ids) == open_before
    remaining = {r["id"] for r in await pool.fetch("SELECT id FROM deliveries")}
    assert remaining == set(seeded.deliveries.values()) - {
        seeded.deliveries[label] for label in history.DELETED
    }
    purged = await pool.fetch(
        "SELECT id FROM deliveries WHERE content_purged_at IS NOT NULL ORDER BY id"
    )
    assert [r["id"] for r in purged] == sorted(
        seeded.deliveries[label] for label in history.CONTENT_PURGED
    )
