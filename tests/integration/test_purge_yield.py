"""`relay purge` gives way to due deliveries (RELAY_RETENTION_PURGE_YIELD_SECONDS,
--yield-seconds) against a real ledger: while one is pending, sending or retrying and due,
each batch first waits (a probe a second) and deletes nothing; once none is due it goes on;
a backlog that never clears holds it up no longer than the bound; the summary, --json and
the run's record say the bound and the time waited; a dry run never waits; a bad bound is
exit 2 naming it."""

from __future__ import annotations

import asyncpg

from service import retention
from service.ledger import Attempt, Completion, State, purge, sending
from service.settings import Settings
from tests.support import relay as rs
from tests.support import retention as history

_json = history.purge_json  # relay purge --json ARGS

# Webhook deliveries that ended 100 days ago: past their content (30) and row (90) periods.
OLD = [history.Spec(f"old_{i}", "webhook", "delivered", 100) for i in range(40)]
DUE = history.Spec("due_now", "webhook", "pending", 0)  # an outbox intent due now


class Drain:
    """The purge's sleep: each call is one second of a drain that claims the due delivery
    after ``claim_at`` waits and delivers it after ``deliver_at`` (never, if None)."""

    def __init__(self, pool: asyncpg.Pool, due: int, claim_at: int, deliver_at: int | None):
        self.pool, self.due = pool, due
        self.claim_at, self.deliver_at = claim_at, deliver_at
        self.seen: list[tuple[float, str, int]] = []  # (slept, due's state, old rows left)

    async def sleep(self, seconds: float) -> None:
        async with self.pool.acquire() as conn:
            state = await conn.fetchval("SELECT state FROM deliveries WHERE id = $1", self.due)
            left = await conn.fetchval("SELECT count(*) FROM deliveries WHERE id <> $1", self.due)
            self.seen.append((seconds, state, left))
            if len(self.seen) == self.claim_at:
                claimed, _ = await sending.claim(conn, [self.due], 600.0)
                assert list(claimed) == [self.due]
            if len(self.seen) == self.deliver_at:
                attempt = Attempt("accepted", 200, 5.0, None, "ok")
                done = await sending.complete(
                    conn,
                    [Completion(self.due, 1, State.DELIVERED, None, 200, None, record=attempt)],
                )
                assert done == {(self.due, 1)}


async def test_a_purge_waits_while_a_delivery_is_due_and_deletes_once_it_is_delivered(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    ids = await history.seed_final(pool, [*OLD, DUE])
    drain = Drain(pool, ids["due_now"], claim_at=2, deliver_at=4)
    now = await pool.fetchval("SELECT now()")
    summary = await purge.purge(
        pool, retention.Policy.from_settings(settings), now, batch_size=10,
        yield_seconds=600, sleep=drain.sleep,
    )  # fmt: skip
    # Pending and due (2 polls), then sending (2 polls): the purge waits, a second each,
    # before its first batch, and has deleted nothing; delivered, it purges all 40.
    assert drain.seen == [
        (1.0, "pending", 40), (1.0, "pending", 40), (1.0, "sending", 40), (1.0, "sending", 40)
    ]  # fmt: skip
    assert (summary.status, summary.rows["deliveries"]) == ("ok", 40)
    assert (summary.yield_seconds, summary.yielded_seconds) == (600, 4.0)
    assert "; waited 4 s (of at most 600) for due deliveries" in summary.render()
    state = await pool.fetchval("SELECT state FROM deliveries WHERE id = $1", ids["due_now"])
    assert state == "delivered"  # finished just now: kept
    recorded = await pool.fetchval("SELECT policy FROM purge_runs WHERE id = $1", summary.run_id)
    assert recorded["yield_seconds"] == 600


async def test_a_backlog_that_never_clears_holds_the_purge_up_no_longer_than_its_bound(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    ids = await history.seed_final(pool, [*OLD, DUE])
    drain = Drain(pool, ids["due_now"], claim_at=0, deliver_at=None)
    now = await pool.fetchval("SELECT now()")
    summary = await purge.purge(
        pool, retention.Policy.from_settings(settings), now, batch_size=10,
        yield_seconds=3, sleep=drain.sleep,
    )  # fmt: skip
    assert drain.seen == [(1.0, "pending", 40)] * 3  # then the bound is spent: no more waits
    assert (summary.status, summary.rows["deliveries"], summary.yielded_seconds) == ("ok", 40, 3)
    state = await pool.fetchval("SELECT state FROM deliveries WHERE id = $1", ids["due_now"])
    assert state == "pending"  # never touched: not final


async def test_a_delivery_due_later_or_retrying_later_is_not_waited_for(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    ids = await history.seed_final(
        pool, [*OLD, DUE, history.Spec("retry_in_an_hour", "webhook", "retrying", 0)]
    )
    await pool.execute(
        "UPDATE deliveries SET occurrence_at = now() + interval '1 day' WHERE id = $1",
        ids["due_now"],
    )
    drain = Drain(pool, ids["due_now"], claim_at=0, deliver_at=None)
    now = await pool.fetchval("SELECT now()")
    summary = await purge.purge(
        pool, retention.Policy.from_settings(settings), now, batch_size=10,
        yield_seconds=600, sleep=drain.sleep,
    )  # fmt: skip
    assert drain.seen == [] and summary.yielded_seconds == 0
    assert summary.rows["deliveries"] == 40


async def test_relay_purge_reports_its_bound_and_the_time_it_waited(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    await history.seed_final(pool, [*OLD, DUE])
    dry = await _json(settings, "--dry-run", RETENTION_PURGE_YIELD_SECONDS="5")
    assert (dry["yield_seconds"], dry["yielded_seconds"]) == (0, 0)  # a dry run never waits
    assert dry["rows"]["deliveries"] == 40

    # The setting (the one pending delivery stays due): one poll of a second, then on.
    done = await _json(settings, RETENTION_PURGE_YIELD_SECONDS="1")
    assert (done["status"], done["rows"]["deliveries"]) == ("ok", 40)
    assert (done["yield_seconds"], done["yielded_seconds"]) == (1, 1.0)
    assert done["policy"]["yield_seconds"] == 1

    await history.seed_final(pool, OLD[:5])
    text = await rs.relay(settings, "purge", "--yield-seconds", "1", "--rows-per-second", "0")
    assert text.code == 0, text.stderr
    assert "  pace: unpaced; waited 1 s (of at most 1) for due deliveries" in text.stdout
    flag = await _json(settings, "--yield-seconds", "0", RETENTION_PURGE_YIELD_SECONDS="5")
    assert (flag["yield_seconds"], flag["yielded_seconds"]) == (0, 0)


async def test_a_bad_bound_is_exit_2_naming_the_setting_or_the_flag(settings: Settings) -> None:
    bad = await rs.relay(settings, "purge", RETENTION_PURGE_YIELD_SECONDS="-5")
    assert bad.code == 2
    assert "RELAY_RETENTION_PURGE_YIELD_SECONDS: Input should be greater" in bad.stderr
    bad = await rs.relay(settings, "purge", "--yield-seconds", "-1")
    assert bad.code == 2
    assert "--yield-seconds: must be between 0 (never waits) and 86400" in bad.stderr
