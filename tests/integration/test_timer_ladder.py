"""The timer ladder and the overdue sweep (issue 24, item 5), on real servers.

- 3,000 reminders due over the next minute, admitted ahead by several publish runs in
  shuffled order: every one delivered, none early, and none held behind one due later:
  in each lane, the claim order follows the due order (rows due at the same instant are
  ties). With one timer queue of per-message TTLs, a run's long wait at the head held back
  every shorter wait a later run published behind it.
- A message lost from the ladder (a purge) is republished by the consumers' overdue sweep
  soon after its due time; a message the sweep presumed lost that arrives after all finds
  its row final and is acked without a send, and counted.

Facts, not timings: claim order and due times from the ledger, counts at the receiver.
The lateness of each delivery is printed (``-s``); the figure is bench/timer.py's.
"""

from __future__ import annotations

import json
import random
import statistics
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aio_pika
import asyncpg
import pytest

from service.settings import Settings
from tests.support import broker
from tests.support import relay as rs
from tests.support.relay import RunningPartner

ROWS = 3000
RUNS = 5
INSTANTS = 30  # due instants 2 s apart: a minute, 100 reminders at each
SPACING_SECONDS = 2.0
# From loading the first group to the first due instant: room for every run to admit its
# group ahead (each takes a few seconds; the order check counts only rows admitted ahead).
LEAD_SECONDS = 45.0


def _plan(destination: str, first_due: datetime, rng: random.Random) -> list[list[str]]:
    """The reminders in RUNS groups; every group spans the whole minute, a fifth urgent."""
    lines = [
        rs.line(
            f"r{i:04d}",
            destination,
            due_at=first_due + timedelta(seconds=SPACING_SECONDS * (i % INSTANTS)),
            urgent=rng.random() < 0.2,
        )
        for i in range(ROWS)
    ]
    rng.shuffle(lines)
    return [lines[k::RUNS] for k in range(RUNS)]


async def _claims(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    return list(
        await pool.fetch(
            "SELECT d.id, d.urgent, d.occurrence_at, d.published_at, d.first_attempt_at,"
            " d.state::text AS state, a.started_at, d.finished_at"
            " FROM deliveries AS d JOIN delivery_attempts AS a ON a.delivery_id = d.id"
        )
    )


def _held_behind(rows: list[asyncpg.Record]) -> list[str]:
    """Rows claimed after a row of their lane due later (not a tie), with what they were
    claimed after. Rows sharing a claim statement share its timestamp: not an order."""
    found = []
    for urgent in (False, True):
        lane = [r for r in rows if r["urgent"] is urgent]
        lane.sort(key=lambda r: r["first_attempt_at"])
        latest_due = None  # the latest due time among rows claimed strictly earlier
        group_due = None  # ... among rows of the current claim timestamp
        previous_claim = None
        for row in lane:
            if row["first_attempt_at"] != previous_claim:
                if group_due is not None and (latest_due is None or group_due > latest_due):
                    latest_due = group_due
                group_due, previous_claim = None, row["first_attempt_at"]
            if latest_due is not None and row["occurrence_at"] < latest_due:
                found.append(
                    f"{'urgent' if urgent else 'bulk'} {row['id']} due {row['occurrence_at']}"
                    f" claimed {row['first_attempt_at']} after one due {latest_due}"
                )
            if group_due is None or row["occurrence_at"] > group_due:
                group_due = row["occurrence_at"]
    return found


def _lateness_line(rows: list[asyncpg.Record]) -> str:
    started = sorted((r["started_at"] - r["occurrence_at"]).total_seconds() for r in rows)
    accepted = sorted((r["finished_at"] - r["occurrence_at"]).total_seconds() for r in rows)

    def p(values: list[float], share: float) -> float:
        return values[min(len(values) - 1, int(len(values) * share))]

    return (
        f"lateness (s), request started: p50 {statistics.median(started):.3f} "
        f"p99 {p(started, 0.99):.3f} max {started[-1]:.3f}; accepted: "
        f"p50 {statistics.median(accepted):.3f} p99 {p(accepted, 0.99):.3f} max {accepted[-1]:.3f}"
    )


@pytest.mark.timeout(420)
async def test_runs_admitting_ahead_in_shuffled_order_deliver_in_due_order_none_early(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    settings = settings.model_copy(
        update={
            "publish_lookahead_seconds": 180.0,
            # One claim statement at a time: claim timestamps then follow arrival order.
            "database_pool_size": 3,
        }
    )
    first_due = datetime.now(UTC) + timedelta(seconds=LEAD_SECONDS)
    groups = _plan(partner.url(), first_due, random.Random(24))
    consumer = await rs.start_consumer(settings, tmp_path / "consumer.log")
    try:
        await rs.wait_for(lambda: rs.topology_declared(settings), 30, "consumer up")
        for group in groups:
            await rs.load(pool, group)
            published = await rs.relay(settings, "publish", timeout=120)
            assert published.code == 0, published.stdout + published.stderr[-2000:]

        async def all_delivered() -> bool:
            return (await rs.states(pool)).get("delivered", 0) == ROWS

        await rs.wait_for(all_delivered, LEAD_SECONDS + 300, f"all {ROWS} delivered")
    finally:
        assert await rs.stop(consumer) == 0

    rows = await _claims(pool)
    assert len(rows) == ROWS  # one attempt each
    early = [r["id"] for r in rows if r["started_at"] < r["occurrence_at"]]
    assert early == [], f"{len(early)} requests started before their due time"
    assert partner.state.logical_events == ROWS and partner.state.duplicates == 0
    runs = await pool.fetch("SELECT created_count FROM publish_runs ORDER BY id")
    assert [r["created_count"] for r in runs] == [ROWS // RUNS] * RUNS
    # Only rows that waited in the ladder: queued at least a second before they were due.
    ahead = [r for r in rows if r["published_at"] <= r["occurrence_at"] - timedelta(seconds=1)]
    assert len(ahead) >= 0.9 * ROWS, (
        f"only {len(ahead)} of {ROWS} admitted ahead: the runs took longer than the lead"
    )
    held = _held_behind(ahead)
    print(f"\n{len(ahead)} admitted ahead; {_lateness_line(rows)}")
    assert held == [], f"{len(held)} held behind a later-due delivery: {held[:5]}"


@pytest.mark.timeout(180)
async def test_a_lost_ladder_message_is_republished_after_due_and_a_survivor_is_a_counted_no_op(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    after = 3.0
    settings = settings.model_copy(
        update={"overdue_after_seconds": after, "overdue_sweep_seconds": 0.5}
    )
    # Far enough ahead that a publish run started on a busy machine still finds it ahead.
    due = datetime.now(UTC) + timedelta(seconds=20)
    await rs.load(pool, [rs.line(f"lost{i}", partner.url(), due_at=due) for i in range(10)])
    assert (await rs.relay(settings, "publish")).code == 0
    topology = broker.topology(settings)
    # An operator's purge, longest level first: a message only ever moves to a shorter one.
    assert await broker.purge(settings, topology.timer_queues[::-1]) == 10

    # Ten more, due now, whose messages a stuck consumer holds unacked: not lost, not ready.
    past = datetime.now(UTC) - timedelta(seconds=1)
    await rs.load(pool, [rs.line(f"held{i}", partner.url(), due_at=past) for i in range(10)])
    assert (await rs.relay(settings, "publish")).code == 0
    stuck = await aio_pika.connect(settings.amqp_url.get_secret_value())
    channel = await stuck.channel()
    await channel.set_qos(prefetch_count=10)
    held: list[aio_pika.abc.AbstractIncomingMessage] = []

    async def hold(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        held.append(message)  # never acked

    async def holds_ten() -> bool:
        return len(held) == 10

    lane = await channel.declare_queue(topology.lane_queue("bulk"), passive=True)
    await lane.consume(hold)
    await rs.wait_for(holds_ten, 20, "the stuck consumer holds ten")

    consumer = await rs.start_consumer(settings, tmp_path / "consumer.log")
    try:

        async def all_delivered() -> bool:
            return (await rs.states(pool)).get("delivered", 0) == 20

        await rs.wait_for(all_delivered, 90, "every row delivered through the sweep")
        await stuck.close()  # the ten originals go back to the lane, to the real consumer

        async def drained() -> bool:
            return (
                await broker.waiting(settings) == 0
                and await rs.logged_count(tmp_path / "consumer.log", "duplicate", republished=True)
                == 10
            )

        await rs.wait_for(drained, 60, "the ten originals acked as counted duplicates")
    finally:
        assert await rs.stop(consumer) == 0
    rows = await pool.fetch(
        "SELECT id, reminder_id, occurrence_at, republished_at, republishes, attempts"
        " FROM deliveries ORDER BY id"
    )
    assert all(r["republishes"] >= 1 and r["attempts"] == 1 for r in rows), rows
    for r in rows:
        late = (r["republished_at"] - r["occurrence_at"]).total_seconds()
        # Not before the sweep's margin, and not a rescue interval later.
        assert after <= late <= settings.lease_seconds + 30, (r["reminder_id"], late)
    assert partner.state.logical_events == 20 and partner.state.duplicates == 0
    # An operator sees it too: deliveries show tells when and how often it was republished.
    shown = await rs.relay(settings, "deliveries", "show", str(rows[0]["id"]), "--json")
    assert shown.code == 0, shown.stderr
    story = json.loads(shown.stdout)
    assert story["republishes"] == rows[0]["republishes"] and story["republished_at"]
