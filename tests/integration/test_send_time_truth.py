"""Send-time truth: the send decision is taken after every wait, against the ledger as it is
then. Real consumer process, real PostgreSQL, RabbitMQ and HTTP.

The rows below are claimed at once and then wait for a shared rate budget; what changes
meanwhile (a cancel, the passing of ``stale_after``) must be obeyed when their turn comes.
Every assertion is about facts recorded by the partner and the ledger, not about speed.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from service import destination_switch, destinations, outbox
from service.settings import Settings
from tests.support import forked
from tests.support import relay as rs
from tests.support.relay import RunningPartner


@dataclass(frozen=True)
class Arrival:
    at: float  # time.monotonic() in this process
    reminder_id: str
    stale_header: bool


def _record_arrivals(partner: RunningPartner) -> list[Arrival]:
    arrivals: list[Arrival] = []

    def hook(name: str, key: str) -> None:
        # key: reminder:<id>:<occurrence>:<channel>
        stale = partner.state.last_headers.get("x-relay-stale") == "true"
        arrivals.append(Arrival(time.monotonic(), key.split(":")[1], stale))

    partner.state.on_request = hook
    return arrivals


async def _all_final(pool: asyncpg.Pool, n: int) -> bool:
    counts = await rs.states(pool)
    return sum(counts.get(s, 0) for s in ("delivered", "skipped", "dead")) == n


async def _stop(consumer: forked.RelayProcess) -> int:
    if consumer.returncode is None:
        consumer.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(consumer.wait(), 30)


def _error_lines(log: Path) -> list[str]:
    bad = []
    for text in log.read_text().splitlines() if log.exists() else []:
        try:
            entry = json.loads(text)
        except ValueError:
            bad.append(text)  # not a JSON line: a raw traceback
            continue
        if entry.get("level") in ("ERROR", "CRITICAL") or "exc_info" in entry:
            bad.append(text)
    return bad


async def _blocked_cancels(pool: asyncpg.Pool) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE '%UPDATE reminders SET active = false%'"
        )
    )


@pytest.mark.timeout(180)
async def test_cancel_committed_during_a_budget_wait_is_never_sent(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    """Budget 1/s, six reminders claimed together: the first is sent at once, the others
    wait their turn. All six are cancelled right after the first arrives. Nothing may
    arrive after the cancels committed; the waiting rows end skipped 'cancelled'.

    To know exactly when the cancels commit, the six ``relay reminders cancel`` processes
    are started first and held on a row lock this test takes on the reminders; the lock
    is released right after the first request arrives, so every cancel commits (on the
    server, without another client round trip) within moments of that instant, while the
    other rows are still waiting for their budget tokens.
    """
    settings = settings.model_copy(update={"lease_seconds": 120.0})
    arrivals = _record_arrivals(partner)
    ids = [f"c{i}" for i in range(6)]
    await rs.load(pool, [rs.line(i, partner.url("cal")) for i in ids])
    assert (await rs.relay(settings, "publish")).code == 0

    blocker = await pool.acquire()
    consumer: forked.RelayProcess | None = None
    log = tmp_path / "consumer.log"
    try:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("SELECT id FROM reminders ORDER BY id FOR UPDATE")
        cancels = [
            asyncio.create_task(
                rs.relay(settings, "reminders", "cancel", i, DATABASE_COMMAND_TIMEOUT_SECONDS="120")
            )
            for i in ids
        ]

        async def all_blocked() -> bool:
            return await _blocked_cancels(pool) == len(ids)

        await rs.wait_for(all_blocked, 60, "six cancels waiting on the reminders' lock")

        consumer = await rs.start_consumer(settings, log, BUDGETS="webhook=1/1")

        async def first_arrived() -> bool:
            return bool(arrivals)

        await rs.wait_for(first_arrived, 60, "the first request at the partner", interval=0.005)
        released_at = time.monotonic()
        released_at_db = await blocker.fetchval("SELECT clock_timestamp()")
        await tx.rollback()

        results = await asyncio.wait_for(asyncio.gather(*cancels), 60)
        assert [r.code for r in results] == [0] * len(ids), [r.stderr for r in results]
        assert await pool.fetchval("SELECT count(*) FROM reminders WHERE active") == 0

        await rs.wait_for(lambda: _all_final(pool, len(ids)), 60, "every row final")
        code = await _stop(consumer)
    finally:
        await pool.release(blocker)
        if consumer is not None and consumer.returncode is None:
            consumer.kill()
            await consumer.wait()

    assert code == 0
    # Every cancel committed after ``released_at``: nothing arrived after it.
    late = [a for a in arrivals if a.at > released_at]
    assert late == [], f"sent after the cancels committed: {late}"

    sent = {a.reminder_id for a in arrivals}
    rows = await pool.fetch(
        "SELECT id, reminder_id, state::text AS state, skip_reason, attempts, first_attempt_at "
        "FROM deliveries ORDER BY id"
    )
    delivered = {r["reminder_id"] for r in rows if r["state"] == "delivered"}
    skipped = [r for r in rows if r["state"] == "skipped"]
    assert delivered == sent
    assert len(sent) + len(skipped) == len(ids)
    # The release came right after the first arrival, with the other rows still waiting.
    assert len(skipped) >= 4, [tuple(r) for r in rows]
    for row in skipped:
        assert row["skip_reason"] == "cancelled"
        # Claimed before the cancel: the skip was decided after the budget wait.
        assert row["first_attempt_at"] < released_at_db
        assert row["attempts"] == 1
    attempts = await pool.fetch(
        "SELECT delivery_id, attempt, outcome, error FROM delivery_attempts "
        "WHERE delivery_id = ANY($1::bigint[]) ORDER BY delivery_id",
        [r["id"] for r in skipped],
    )
    assert [(a["attempt"], a["outcome"], a["error"]) for a in attempts] == [
        (1, "skipped", "cancelled")
    ] * len(skipped)
    assert partner.state.logical_events == len(sent) and partner.state.duplicates == 0
    assert _error_lines(log) == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("send_stale", [False, True], ids=["skip-stale", "send-stale"])
async def test_stale_after_crossed_during_a_budget_wait_is_obeyed_at_send_time(
    settings: Settings,
    pool: asyncpg.Pool,
    partner: RunningPartner,
    tmp_path: Path,
    send_stale: bool,
) -> None:
    """One token every 12 s, three reminders with ``stale_after`` 10 s, claimed while
    fresh: the first goes at once (fresh); the others get their tokens when older than 10 s,
    so they are skipped 'stale' or, with ``send_stale``, sent with the attempt marked stale.
    (10 s: on a loaded machine the publish run and the claim took 6 s after the due time.)
    """
    stale_after = 10.0
    settings = settings.model_copy(update={"lease_seconds": 120.0})
    arrivals = _record_arrivals(partner)
    log = tmp_path / "consumer.log"
    consumer = await rs.start_consumer(settings, log, BUDGETS="webhook=0.0833/1")
    try:
        await rs.wait_for(lambda: rs.topology_declared(settings), 30, "consumer up")
        now = datetime.now(UTC)
        lines = [
            rs.line(
                f"s{i}",
                partner.url("st"),
                due_at=now,
                stale_after=stale_after,
                send_stale=send_stale,
            )
            for i in range(3)
        ]
        await rs.load(pool, lines)
        assert (await rs.relay(settings, "publish")).code == 0
        await rs.wait_for(lambda: _all_final(pool, 3), 90, "every row final")
        assert await _stop(consumer) == 0
    finally:
        if consumer.returncode is None:
            consumer.kill()
            await consumer.wait()

    rows = await pool.fetch(
        "SELECT d.id, d.reminder_id, d.state::text AS state, d.skip_reason, "
        "extract(epoch FROM d.first_attempt_at - d.occurrence_at)::float8 AS claim_age, "
        "extract(epoch FROM d.finished_at - d.occurrence_at)::float8 AS final_age, "
        "a.outcome, a.stale, "
        "extract(epoch FROM a.started_at - d.occurrence_at)::float8 AS send_age "
        "FROM deliveries d JOIN delivery_attempts a ON a.delivery_id = d.id ORDER BY d.id"
    )
    assert len(rows) == 3  # one attempt each: nothing was deferred and tried again
    # The precondition of the scenario: every row was claimed while still fresh.
    assert all(r["claim_age"] < stale_after for r in rows), [tuple(r) for r in rows]
    fresh = [r for r in rows if r["state"] == "delivered" and not r["stale"]]
    late = [r for r in rows if r not in fresh]
    assert len(fresh) == 1 and fresh[0]["send_age"] < stale_after, [tuple(r) for r in rows]
    assert len(late) == 2
    if send_stale:
        for r in late:
            assert (r["state"], r["outcome"], r["stale"]) == ("delivered", "accepted", True)
            assert r["send_age"] > stale_after
        assert sorted(a.stale_header for a in arrivals) == [False, True, True]
        assert partner.state.logical_events == 3
    else:
        for r in late:
            assert (r["state"], r["skip_reason"], r["outcome"]) == ("skipped", "stale", "skipped")
            assert r["final_age"] > stale_after
        assert [a.reminder_id for a in arrivals] == [fresh[0]["reminder_id"]]
        assert not arrivals[0].stale_header
    assert _error_lines(log) == []


@pytest.mark.timeout(180)
async def test_destination_disabled_during_a_budget_wait_is_held_without_a_request(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    """Four outbox intents (always active: no reminder to cancel) to one destination,
    one token every 5 s. Right after the first request arrives, another replica's 410
    disables the destination; the three still waiting are held at their turn: no request,
    no attempt counted, never dead. Enabled again, they are delivered."""
    settings = settings.model_copy(update={"lease_seconds": 120.0})
    arrivals: list[float] = []
    partner.state.on_request = lambda name, key: arrivals.append(time.monotonic())
    destination = partner.url("gone-soon")
    async with pool.acquire() as conn, conn.transaction():
        for i in range(4):
            await outbox.add_intent(
                conn,
                key=f"intent-{i}",
                channel="webhook",
                destination=destination,
                payload={"n": i},
                allow_networks=rs.LOOPBACK,
            )
    assert (await rs.relay(settings, "publish")).code == 0
    log = tmp_path / "consumer.log"
    consumer = await rs.start_consumer(  # DEBUG: every deferral, not one a minute
        settings, log, BUDGETS="webhook=0.2/1", DESTINATION_HOLD_SECONDS="1", LOG_LEVEL="DEBUG"
    )
    try:

        async def first_arrived() -> bool:
            return bool(arrivals)

        await rs.wait_for(first_arrived, 60, "the first request", interval=0.005)
        await destinations.disable(pool, destination, "410 gone")
        disabled_at = time.monotonic()

        async def three_held() -> bool:
            held = await pool.fetchval(
                "SELECT count(*) FROM deliveries WHERE state = 'retrying' AND attempts = 0"
                " AND last_error IS NULL"
            )
            return held == 3 and await _deferred_for_disabled(log) >= 3

        await rs.wait_for(three_held, 90, "three rows held")
        assert [t for t in arrivals if t > disabled_at] == []
        assert await pool.fetchval("SELECT count(*) FROM delivery_attempts") == 1
        async with pool.acquire() as conn:
            enabled = await destination_switch.enable(
                conn,
                destination,
                now=datetime.now(UTC),
                missed=destination_switch.MissedFire.of(settings),
                apply=True,
                operator="test",
                reason="back",
            )
        # Sent: the held rows not claimed at this instant. A row re-checking its hold right
        # now (claimed) is not counted, and comes back on its own.
        assert enabled is not None and enabled.held_send <= 3
        await rs.wait_for(lambda: _all_final(pool, 4), 90, "every row final")
        assert await _stop(consumer) == 0
    finally:
        if consumer.returncode is None:
            consumer.kill()
            await consumer.wait()

    states = await pool.fetch("SELECT state::text AS state, attempts FROM deliveries")
    assert [(r["state"], r["attempts"]) for r in states] == [("delivered", 1)] * 4
    assert partner.state.logical_events == 4


async def _deferred_for_disabled(log: Path) -> int:
    """Deferrals logged because the destination is disabled."""
    if not log.exists():
        return 0
    count = 0
    for text in log.read_text().splitlines():
        try:
            record = json.loads(text)
        except ValueError:
            continue
        if record.get("event") == "deferred" and record.get("reason") == "destination disabled":
            count += 1
    return count
