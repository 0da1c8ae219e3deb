"""Consumer processes killed with SIGKILL at named points, and stopped with SIGTERM.

Each crash test arms one point with RELAY_CRASH_AT in a real ``relay consume``
subprocess, which SIGKILLs itself there, then runs a clean consumer and checks that the
partner saw exactly one logical event and the ledger tells the truth.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import asyncpg

from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import forked
from tests.support import relay as rs
from tests.support.relay import RunningPartner


async def _crash_then_recover(settings: Settings, point: str, log: Path) -> forked.RelayProcess:
    crashing = await rs.start_consumer(settings, CRASH_AT=point)
    code = await asyncio.wait_for(crashing.wait(), 30)
    assert code == -signal.SIGKILL, f"consumer was not killed at {point} (exit {code})"
    return await rs.start_consumer(settings, log_path=log)


async def _one_row(pool: asyncpg.Pool) -> asyncpg.Record:
    row = await pool.fetchrow("SELECT * FROM deliveries")
    assert row is not None
    return row


async def test_killed_after_partner_accepted_before_outcome_written_resends_same_key_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    await rs.load(pool, [rs.line("r1", partner.url())])
    assert (await rs.relay(settings, "publish")).code == 0

    recovered = await _crash_then_recover(settings, "after_send", tmp_path / "consumer.log")
    try:

        async def delivered() -> bool:
            return (await _one_row(pool))["state"] == "delivered"

        # The redelivered message waits for the dead consumer's lease (3 s) to expire.
        await rs.wait_for(delivered, 30, "row delivered after the crash")
    finally:
        assert await rs.stop(recovered) == 0
    row = await _one_row(pool)
    assert row["attempts"] == 2
    assert partner.state.logical_events == 1
    assert partner.state.events[row["idempotency_key"]] == 2  # same key both times
    assert partner.state.duplicates == 1
    outcomes = await pool.fetch("SELECT attempt, outcome FROM delivery_attempts ORDER BY attempt")
    assert [(a["attempt"], a["outcome"]) for a in outcomes] == [(1, "lost"), (2, "accepted")]


async def test_killed_after_commit_before_ack_is_acked_without_a_second_send(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    await rs.load(pool, [rs.line("r1", partner.url())])
    assert (await rs.relay(settings, "publish")).code == 0

    log = tmp_path / "consumer.log"
    recovered = await _crash_then_recover(settings, "after_write", log)
    try:
        assert (await _one_row(pool))["state"] == "delivered"
        # The redelivered message reaches the new consumer, which must not send again.
        await rs.wait_for(lambda: rs.logged(log, "duplicate"), 20, "redelivery acked")
    finally:
        assert await rs.stop(recovered) == 0
    row = await _one_row(pool)
    assert row["attempts"] == 1
    assert sum(partner.state.requests_by_path.values()) == 1
    assert partner.state.logical_events == 1


async def test_sigterm_finishes_in_flight_deliveries_and_loses_nothing(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    # Requests held 1.5 s, so some are on the wire at the SIGTERM; the HTTP timeout (and
    # the lease, which must exceed it) well past that: at 2 s, requests slowed by a busy
    # machine timed out and were resent, the same key twice (30 duplicates in one run).
    settings = settings.model_copy(update={"http_timeout_seconds": 8.0, "lease_seconds": 12.0})
    partner.state.rules["slow"] = partner_mod.PathRule(delay_seconds=1.5)
    await rs.load(pool, [rs.line(f"r{i}", partner.url("slow")) for i in range(40)])
    assert (await rs.relay(settings, "publish")).code == 0

    first = await rs.start_consumer(settings, PREFETCH="10")

    async def some_in_flight() -> bool:
        return sum(partner.state.requests_by_path.values()) > 0

    await rs.wait_for(some_in_flight, 20, "requests in flight")
    assert await rs.stop(first) == 0
    states = await rs.states(pool)
    # Everything the first consumer started, it finished: nothing is left 'sending'.
    assert "sending" not in states, states
    finished_by_first = states.get("delivered", 0)
    assert finished_by_first >= 1

    second = await rs.start_consumer(settings)
    try:
        await rs.wait_for(lambda: _all_delivered(pool, 40), 60, "all 40 delivered")
    finally:
        assert await rs.stop(second) == 0
    assert partner.state.logical_events == 40
    assert partner.state.duplicates == 0
    assert sum(partner.state.requests_by_path.values()) == 40


async def _all_delivered(pool: asyncpg.Pool, n: int) -> bool:
    return (await rs.states(pool)).get("delivered", 0) == n
