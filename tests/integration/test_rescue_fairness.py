"""Rescue is fair and bounded: oldest overdue first across every state it rescues, each row
at most once per rescue interval, and never more messages in the lanes than rows owed
plus one batch. Rows are put into their states through the ledger with SQL; rescue and
publish run as real ``relay`` processes; consumers are down throughout, so every message
a run publishes stays countable in the queues.
"""

from __future__ import annotations

import asyncio
import re
import signal
from datetime import datetime
from pathlib import Path

import asyncpg
import pytest

from service import messages, outbox
from service.settings import Settings
from tests.support import broker
from tests.support import relay as rs

LIMIT = 2


async def _intent(pool: asyncpg.Pool, key: str) -> int:
    async with pool.acquire() as conn, conn.transaction():
        delivery_id = await outbox.add_intent(
            conn,
            key=key,
            channel="webhook",
            destination="http://127.0.0.1:9/hooks/x",
            allow_networks=rs.LOOPBACK,
            payload={"text": key},
        )
    assert delivery_id is not None
    return delivery_id


# How long ago a row's message was due to arrive (negative: not yet) is set through the
# column rescue reads for its state: queued -> published_at (or its occurrence, when that
# is later: a row admitted ahead of its time) + R; retrying ->
# next_attempt_at + R; sending -> lease_expires_at (R: the rescue interval).
_SET = {
    "queued": "UPDATE deliveries SET state = 'queued', "
    "published_at = now() - make_interval(secs => $2), "
    "occurrence_at = now() - make_interval(secs => $2) WHERE id = $1",
    "retrying": "UPDATE deliveries SET state = 'retrying', attempts = 1, "
    "next_attempt_at = now() - make_interval(secs => $2) WHERE id = $1",
    "sending": "UPDATE deliveries SET state = 'sending', attempts = 1, published_at = now(), "
    "lease_expires_at = now() - make_interval(secs => $2) WHERE id = $1",
    "delivered": "UPDATE deliveries SET state = 'delivered', attempts = 1, finished_at = now(), "
    "published_at = now() - make_interval(secs => $2) WHERE id = $1",
}


async def _row(
    pool: asyncpg.Pool, name: str, state: str, overdue: float, rescue_after: float
) -> int:
    """A row whose message has been missing for ``overdue`` seconds past its rescue time."""
    delivery_id = await _intent(pool, name)
    seconds_ago = overdue if state == "sending" else overdue + rescue_after
    await pool.execute(_SET[state], delivery_id, seconds_ago)
    return delivery_id


def _rescued(stdout: str) -> int:
    match = re.search(r"rescued=(\d+)", stdout)
    assert match, stdout
    return int(match.group(1))


async def _stamps(pool: asyncpg.Pool) -> dict[int, datetime]:
    rows = await pool.fetch("SELECT id, rescued_at FROM deliveries WHERE rescued_at IS NOT NULL")
    return {r["id"]: r["rescued_at"] for r in rows}


async def _owed(pool: asyncpg.Pool) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM deliveries WHERE state IN ('queued', 'retrying', 'sending')"
        )
    )


async def _lane_ids(settings: Settings) -> list[int]:
    ids = []
    for name in broker.lanes_and_tiers(settings):
        for message in await broker.read(settings, name, remove=False):
            ids.append(messages.decode(message.body).delivery_id)
    return sorted(ids)


@pytest.mark.timeout(180)
async def test_rescue_takes_the_oldest_overdue_first_across_states_each_row_once(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    rescue_after = 30.0  # the interval: the runs below all happen well within it
    settings = settings.model_copy(
        update={"rescue_after_seconds": rescue_after, "rescue_batch_limit": LIMIT}
    )
    # Overdue rows, oldest first by how long their message has been missing.
    plan = [
        ("b-queued", "queued", 110.0),
        ("a-sending", "sending", 100.0),
        ("c-retrying", "retrying", 90.0),
        ("d-queued", "queued", 80.0),
        ("e-sending", "sending", 70.0),
        ("f-retrying", "retrying", 60.0),
    ]
    overdue = [await _row(pool, n, s, o, rescue_after) for n, s, o in plan]
    # Rows rescue must leave alone: not overdue yet, or final.
    not_yet = [
        await _row(pool, "g-queued-recent", "queued", -20.0, rescue_after),
        await _row(pool, "h-retrying-later", "retrying", -3600.0, rescue_after),
        await _row(pool, "i-sending-live", "sending", -60.0, rescue_after),
        await _row(pool, "j-delivered", "delivered", 500.0, rescue_after),
    ]
    owed = await _owed(pool)
    assert owed == 9

    order: list[set[int]] = []
    for run in range(3):
        before = await _stamps(pool)
        result = await rs.relay(settings, "rescue")
        assert result.code == 0, result.stdout + result.stderr
        assert _rescued(result.stdout) == LIMIT, (run, result.stdout)
        after = await _stamps(pool)
        assert {k: v for k, v in after.items() if k in before} == before  # none stamped again
        order.append(set(after) - set(before))
        assert await broker.waiting(settings) <= await _owed(pool) + LIMIT

    assert order == [set(overdue[0:2]), set(overdue[2:4]), set(overdue[4:6])]
    # Within the interval a further run finds nothing left to rescue.
    again = await rs.relay(settings, "rescue")
    assert again.code == 0 and _rescued(again.stdout) == 0, again.stdout
    # One message per overdue row, none for the others; the lanes hold no more than owed.
    assert await _lane_ids(settings) == sorted(overdue)
    assert not set(await _stamps(pool)) & set(not_yet)
    runs = await pool.fetch("SELECT kind, rescued_count FROM publish_runs ORDER BY id")
    assert [(r["kind"], r["rescued_count"]) for r in runs] == [("rescue", 2)] * 3 + [("rescue", 0)]


@pytest.mark.timeout(240)
async def test_with_consumers_down_repeated_publish_runs_keep_messages_within_owed_plus_a_batch(
    settings: Settings, pool: asyncpg.Pool, partner: rs.RunningPartner
) -> None:
    """50 rows queued, their messages purged, 20 more reminders due later; one publish
    run after another (each one admits, sweeps and rescues) with no consumer running."""
    batch = 15
    rescue_after = 1.0
    settings = settings.model_copy(
        update={"rescue_after_seconds": rescue_after, "rescue_batch_limit": batch}
    )
    await rs.load(pool, [rs.line(f"r{i}", partner.url()) for i in range(50)])
    assert (await rs.relay(settings, "publish")).code == 0
    assert await broker.purge(settings, broker.lanes_and_tiers(settings)) == 50
    # Their messages are gone; the ledger still owes all 50, overdue since an hour ago. Their
    # due time goes back too: rescue waits rescue_after past the later of the two, and the
    # six runs below can all end within a second of the load (they did once, and none
    # rescued).
    await pool.execute(
        "UPDATE deliveries SET published_at = now() - interval '1 hour',"
        " occurrence_at = now() - interval '1 hour'"
    )
    late = [rs.line(f"late{i}", partner.url(), due_at=None) for i in range(20)]
    await rs.load(pool, late)  # due now: the next run admits them

    seen: list[tuple[int, int]] = []
    for _ in range(6):
        result = await rs.relay(settings, "publish")
        assert result.code == 0, result.stdout + result.stderr
        waiting, owed = await broker.waiting(settings), await _owed(pool)
        seen.append((waiting, owed))
        assert waiting <= owed + batch, seen
    assert seen[-1][1] == 70
    runs = await pool.fetch("SELECT rescued_count FROM publish_runs WHERE kind = 'publish'")
    assert sum(r["rescued_count"] for r in runs) > 0  # rescue did run, within its cap


@pytest.mark.timeout(240)
async def test_a_row_rescued_in_an_earlier_interval_does_not_go_before_one_never_rescued(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    """Consumers down, six rows whose messages were lost, two rescued per run, runs further
    apart than the rescue interval. Each run must move on to rows not yet rescued: a row
    whose rescued message is still waiting in the queue gains nothing from another copy,
    while a row never rescued has no message at all."""
    rescue_after = 2.0
    settings = settings.model_copy(
        update={"rescue_after_seconds": rescue_after, "rescue_batch_limit": LIMIT}
    )
    plan = [(f"q{i}", "queued", 100.0 - i) for i in range(6)]
    overdue = [await _row(pool, n, s, o, rescue_after) for n, s, o in plan]

    for _ in range(3):
        result = await rs.relay(settings, "rescue")
        assert result.code == 0, result.stdout + result.stderr

        async def interval_passed() -> bool:
            return bool(
                await pool.fetchval(
                    "SELECT max(rescued_at) < now() - make_interval(secs => $1) FROM deliveries",
                    rescue_after,
                )
            )

        await rs.wait_for(interval_passed, 20, "one rescue interval on the database clock")

    ids = await _lane_ids(settings)
    assert sorted(set(ids)) == sorted(overdue), f"rescued: {ids}, owed: {overdue}"


_LOST_ROWS = """
INSERT INTO deliveries (id, idempotency_key, source, channel, provider, destination, payload,
                        occurrence_at, state, published_at)
SELECT g, 'outbox:lost-' || g, 'outbox', 'webhook', 'webhook', $3, '{"n": 1}'::jsonb,
       now() - interval '1 hour', 'queued', now() - interval '1 hour'
FROM generate_series($1::bigint, $2::bigint) AS g
ORDER BY random()
"""


@pytest.mark.timeout(480)
async def test_rescue_runs_beside_consumers_working_the_rows_they_rescue_all_succeed(
    settings: Settings, pool: asyncpg.Pool, partner: rs.RunningPartner, tmp_path: Path
) -> None:
    """Rows whose messages were lost (inserted in random physical order, as a busy table
    holds them), rescued while two consumers claim and complete the very rows the rescue
    run is stamping. Every run must end well (no deadlock surfaces as a failed run), and
    further runs recover whatever one run's batch did not reach."""
    rows_per_run, runs = 3000, 5
    total = rows_per_run * runs
    settings = settings.model_copy(update={"rescue_after_seconds": 5.0})
    consumers = [await rs.start_consumer(settings, tmp_path / f"c{i}.log") for i in range(2)]
    results: list[rs.Result] = []

    async def all_delivered() -> bool:
        return (await rs.states(pool)).get("delivered", 0) == total

    try:
        await rs.wait_for(lambda: rs.topology_declared(settings), 30, "consumers up")
        for run in range(runs):
            first = 1_000_000 + run * rows_per_run
            await pool.execute(_LOST_ROWS, first, first + rows_per_run - 1, partner.url())
            results.append(await rs.relay(settings, "rescue", timeout=180))
        # Later runs (a CronJob's next minutes) pick up what the batches did not reach.
        for _ in range(30):
            if await all_delivered():
                break
            await rs.wait_for(lambda: _quiet(settings), 180, "lanes drained", interval=0.5)
            results.append(await rs.relay(settings, "rescue", timeout=180))
        await rs.wait_for(all_delivered, 120, "every rescued row delivered", interval=0.5)
    finally:
        for proc in consumers:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        codes = [await asyncio.wait_for(p.wait(), 30) for p in consumers]
    failures = [(r.code, r.stderr.strip().splitlines()[-3:]) for r in results if r.code != 0]
    assert failures == [], f"{len(failures)} of {len(results)} rescue runs failed: {failures}"
    assert not any("Traceback" in r.stderr for r in results)
    assert codes == [0, 0]
    assert partner.state.logical_events == total


async def _quiet(settings: Settings) -> bool:
    return await broker.waiting(settings) == 0
