"""A paced `relay purge` (RELAY_RETENTION_PURGE_ROWS_PER_SECOND, --rows-per-second) against a
real ledger: it sleeps after each committed batch, never inside a transaction, records the
cap with the run and reports the time it spent paced; a dry run is not paced; a bad cap is
exit 2 naming it."""

from __future__ import annotations

import asyncpg

from service import retention
from service.ledger import purge
from service.settings import Settings
from tests.support import relay as rs
from tests.support import retention as history

_json = history.purge_json  # relay purge --json ARGS

# Webhook deliveries that ended 100 days ago: past their content (30) and row (90) periods.
OLD = [history.Spec(f"old_{i}", "webhook", "delivered", 100) for i in range(40)]

# Any other client backend of this database inside a transaction (the purge's, if it sleeps
# in one), and any lock one holds on deliveries.
_OPEN_TRANSACTIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND backend_type = 'client backend'
  AND pid <> pg_backend_pid() AND xact_start IS NOT NULL
"""
_DELIVERY_LOCKS = """
SELECT count(*) FROM pg_locks
WHERE relation = 'deliveries'::regclass AND pid <> pg_backend_pid()
"""


class FakeClock:
    """Time moves only when the purge sleeps: every pause is exactly what the cap asks."""

    def __init__(self, pool: asyncpg.Pool, ids: list[int]) -> None:
        self.now = 0.0
        self.pool, self.ids = pool, ids
        self.seen: list[tuple[float, int, int, int, int]] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        """What another connection sees while the purge sleeps."""
        left = await self.pool.fetchrow(
            "SELECT count(*) AS rows, count(*) FILTER (WHERE payload IS NOT NULL) AS content"
            " FROM deliveries WHERE id = ANY($1)",
            self.ids,
        )
        assert left is not None
        opened = await self.pool.fetchval(_OPEN_TRANSACTIONS)
        locks = await self.pool.fetchval(_DELIVERY_LOCKS)
        self.seen.append((round(seconds, 6), left["rows"], left["content"], opened, locks))
        self.now += seconds


async def test_a_paced_purge_sleeps_after_each_committed_batch_never_inside_one(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    ids = list((await history.seed_final(pool, OLD)).values())
    clock = FakeClock(pool, ids)
    now = await pool.fetchval("SELECT now()")
    summary = await purge.purge(
        pool, retention.Policy.from_settings(settings), now, batch_size=10,
        rows_per_second=100, clock=clock, sleep=clock.sleep,
    )  # fmt: skip
    assert (summary.status, summary.rows["deliveries"]) == ("ok", 40)
    # The content step reads the 40 and passes them over (their rows go in this run): a
    # tenth of a row each against the cap. Then each batch of 10 the rows step deletes, at
    # 100 rows/s: a 0.1 s pause once it committed (its rows already gone for another
    # connection), with no transaction open and no lock on deliveries held.
    assert clock.seen == [
        *[(0.01, 40, 40, 0, 0)] * 4,
        (0.1, 30, 30, 0, 0), (0.1, 20, 20, 0, 0), (0.1, 10, 10, 0, 0), (0.1, 0, 0, 0, 0),
    ]  # fmt: skip
    assert round(summary.paced_seconds, 6) == 0.44 and summary.rows_per_second == 100
    assert summary.content["deliveries"] == 0 and summary.rows["deliveries"] == 40
    recorded = await pool.fetchval("SELECT policy FROM purge_runs WHERE id = $1", summary.run_id)
    assert recorded["rows_per_second"] == 100


async def test_relay_purge_reports_and_records_its_cap_and_the_time_it_spent_paced(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    await history.seed_final(pool, OLD)
    dry = await _json(settings, "--dry-run", "--batch-size", "10", "--rows-per-second", "100")
    assert dry["rows"]["deliveries"] == 40
    assert (dry["rows_per_second"], dry["paced_seconds"]) == (0, 0)  # a dry run is not paced

    done = await _json(settings, "--batch-size", "10", "--rows-per-second", "100")
    assert (done["status"], done["rows"]["deliveries"]) == ("ok", 40)
    assert done["rows_per_second"] == 100 and done["paced_seconds"] > 0
    assert done["policy"]["rows_per_second"] == 100
    (recorded,) = await pool.fetch("SELECT policy FROM purge_runs")
    assert recorded["policy"] == done["policy"]
    assert await pool.fetchval("SELECT count(*) FROM deliveries") == 0

    # The setting is the default; the flag overrides it; 0 is unpaced.
    assert (await _json(settings))["rows_per_second"] == 1500
    by_setting = await _json(settings, RETENTION_PURGE_ROWS_PER_SECOND="0")
    assert (by_setting["rows_per_second"], by_setting["paced_seconds"]) == (0, 0)
    text = await rs.relay(settings, "purge", "--rows-per-second", "250")
    assert text.code == 0 and "  pace: at most 250 rows/s, paced " in text.stdout


async def test_a_bad_cap_is_exit_2_naming_the_setting_or_the_flag(settings: Settings) -> None:
    bad = await rs.relay(settings, "purge", RETENTION_PURGE_ROWS_PER_SECOND="-5")
    assert bad.code == 2
    assert "RELAY_RETENTION_PURGE_ROWS_PER_SECOND: Input should be greater" in bad.stderr
    bad = await rs.relay(settings, "purge", "--rows-per-second", "-1")
    assert bad.code == 2
    assert "--rows-per-second: must be between 0 (unpaced) and 1000000" in bad.stderr
