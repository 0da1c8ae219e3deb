"""`relay runs cancel` and `relay runs dead-letter` reach rows already claimed: none of them
is sent after the command's commit. Real consumer process, real PostgreSQL, RabbitMQ and
HTTP, the real command.

Claimed rows waiting for a paused rate budget are moved by the command at once; when the
budget flows again each one's last check finds it moved, and nothing reaches the partner.
Rows whose request is on the wire at the commit (the partner holds them) finish; the
command waits for their outcome, and one that failed is never sent again.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import asyncpg
import pytest

from service import db
from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import broker, forked
from tests.support import relay as rs
from tests.support.relay import RunningPartner

CLAIMED = 50


async def _run_of(pool: asyncpg.Pool, prefix: str) -> int:
    run_id: int = await pool.fetchval(
        "SELECT DISTINCT run_id FROM deliveries WHERE starts_with(reminder_id, $1)", prefix
    )
    return run_id


async def _states(pool: asyncpg.Pool, run_id: int) -> dict[tuple[str, str | None], int]:
    rows = await pool.fetch(
        "SELECT state::text AS s, skip_reason, count(*) AS n FROM deliveries WHERE run_id = $1"
        " GROUP BY 1, 2",
        run_id,
    )
    return {(r["s"], r["skip_reason"]): r["n"] for r in rows}


async def _events(log: Path, event: str) -> int:
    count = 0
    for text in log.read_text().splitlines() if log.exists() else []:
        try:
            count += json.loads(text).get("event") == event
        except ValueError:
            continue
    return count


def _error_lines(log: Path) -> list[str]:
    bad = []
    for text in log.read_text().splitlines() if log.exists() else []:
        try:
            entry = json.loads(text)
        except ValueError:
            bad.append(text)
            continue
        if entry.get("level") in ("ERROR", "CRITICAL") or "exc_info" in entry:
            bad.append(text)
    return bad


async def _claimed_waiting_for_budget(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, log: Path, prefix: str
) -> tuple[int, forked.RelayProcess]:
    """A run of 50 reminders, every one claimed by a consumer and waiting for a budget of
    10/s that is paused (as a throttle answer leaves it) until the test lets it flow."""
    await rs.load(pool, [rs.line(f"{prefix}{i:02d}", partner.url(prefix)) for i in range(CLAIMED)])
    assert (await rs.relay(settings, "publish")).code == 0
    run_id = await _run_of(pool, prefix)
    await pool.execute(db.q("configure_budget"), "webhook", 10.0, 1.0)
    await pool.execute(db.q("pause_budget"), "webhook", 600.0)
    consumer = await rs.start_consumer(
        settings, log, BUDGETS="webhook=10/1", BUDGET_MAX_WAIT_SECONDS="600"
    )

    async def all_claimed() -> bool:
        return await _states(pool, run_id) == {("sending", None): CLAIMED}

    await rs.wait_for(all_claimed, 60, f"{CLAIMED} rows claimed")

    async def none_stamped() -> bool:
        # Each claim stamped its row, and took the stamp back to wait for the budget.
        stamped = "SELECT count(*) FROM deliveries WHERE last_check_at IS NOT NULL"
        return await pool.fetchval(stamped) == 0

    await rs.wait_for(none_stamped, 60, "every claim waiting for budget")
    assert partner.state.arrivals == []
    return run_id, consumer


async def _let_the_budget_flow_until_every_claim_is_stopped(pool: asyncpg.Pool, log: Path) -> None:
    """Each waiting claim gets its token, then its last check: it must find its row moved."""
    await pool.execute("UPDATE rate_budgets SET paused_until = now()")

    async def all_stopped() -> bool:
        return await _events(log, "stopped") == CLAIMED

    await rs.wait_for(all_stopped, 120, "every claim stopped at its last check", interval=0.5)


async def _stop(consumer: forked.RelayProcess) -> None:
    try:
        assert await rs.stop(consumer) == 0
    finally:
        if consumer.returncode is None:
            consumer.kill()
            await consumer.wait()


@pytest.mark.timeout(300)
async def test_cancel_of_a_run_whose_claims_wait_for_budget_sends_none_of_them(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    settings = settings.model_copy(update={"lease_seconds": 600.0})
    log = tmp_path / "consumer.log"
    run_id, consumer = await _claimed_waiting_for_budget(settings, pool, partner, log, "w")
    try:
        dry = json.loads((await rs.relay(settings, "runs", "cancel", str(run_id), "--json")).stdout)
        assert (dry["applied"], dry["rows"], dry["claimed_stopped"]) == (False, 50, 50)

        started = time.monotonic()
        result = await rs.relay(
            settings, "runs", "cancel", str(run_id), "--apply", "--json", "--reason", "by hand"
        )
        returned = time.monotonic()
        assert result.code == 0, result.stderr
        out = json.loads(result.stdout)
        # The command's counts are the ledger's, at once: every claimed row moved.
        assert (out["applied"], out["changed"], out["rows"]) == (True, True, CLAIMED)
        assert (out["claimed_stopped"], out["on_the_wire"], out["in_flight"]) == (CLAIMED, 0, 0)
        assert await _states(pool, run_id) == {("skipped", "cancelled"): CLAIMED}
        recorded = await pool.fetchrow(
            "SELECT action, rows, claimed_stopped, on_the_wire FROM run_actions"
        )
        assert tuple(recorded) == ("cancel", CLAIMED, CLAIMED, 0)

        await _let_the_budget_flow_until_every_claim_is_stopped(pool, log)
    finally:
        await _stop(consumer)

    # Nothing reached the partner: not after the commit (nor before it: the budget was
    # paused until after the command returned).
    assert [t for t in partner.state.arrivals if t >= started] == []
    assert partner.state.arrivals == [] and partner.state.events == {}
    assert returned > started
    attempts = await pool.fetch("SELECT attempt, outcome, error FROM delivery_attempts")
    assert Counter(tuple(a) for a in attempts) == {(1, "skipped", "cancelled"): CLAIMED}
    assert await _states(pool, run_id) == {("skipped", "cancelled"): CLAIMED}
    assert (
        await pool.fetchval("SELECT count(*) FROM deliveries WHERE last_check_at IS NOT NULL") == 0
    )
    assert _error_lines(log) == []
    text = (await rs.relay(settings, "status", "--run", str(run_id))).stdout
    assert "cancel by" in text and "50 rows (by hand); 50 claimed, stopped before" in text


@pytest.mark.timeout(300)
async def test_dead_letter_of_a_run_whose_claims_wait_for_budget_kills_them_letter_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    settings = settings.model_copy(update={"lease_seconds": 600.0})
    log = tmp_path / "consumer.log"
    run_id, consumer = await _claimed_waiting_for_budget(settings, pool, partner, log, "k")
    try:
        started = time.monotonic()
        result = await rs.relay(
            settings, "runs", "dead-letter", str(run_id), "--apply", "--reason", "bad template"
        )
        assert result.code == 0, result.stderr
        assert f"run {run_id} dead-lettered: 50 rows dead" in result.stdout
        assert "50 of them claimed by a consumer and stopped before their request" in result.stdout
        assert "0 on the wire at the commit" in result.stdout
        assert f"nothing of run {run_id} is being sent or will be sent" in result.stdout
        assert await _states(pool, run_id) == {("dead", None): CLAIMED}

        await _let_the_budget_flow_until_every_claim_is_stopped(pool, log)

        async def lettered() -> bool:
            return await broker.dead_count(settings) >= CLAIMED

        await rs.wait_for(lettered, 60, "a dead letter for each row")
    finally:
        await _stop(consumer)

    assert [t for t in partner.state.arrivals if t >= started] == []
    assert partner.state.events == {}
    letters = await broker.read(settings, broker.topology(settings).dead_queue, remove=False)
    ids = [m.headers["x-relay-delivery-id"] for m in letters]
    assert len(ids) == CLAIMED and len(set(ids)) == CLAIMED  # each once
    rows = await pool.fetch(
        "SELECT id, last_error, dead_lettered_at FROM deliveries WHERE run_id = $1", run_id
    )
    assert sorted(ids) == sorted(r["id"] for r in rows)
    assert {r["last_error"] for r in rows} == {"dead-lettered by an operator: bad template"}
    assert all(r["dead_lettered_at"] is not None for r in rows)
    assert _error_lines(log) == []


@pytest.mark.timeout(240)
async def test_cancel_waits_for_requests_on_the_wire_and_a_failed_one_is_never_sent_again(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    """Three requests held by the partner (3 s, then 503) when the cancel commits: they are
    on the wire, not stopped; the command waits for their outcome, and the failures that
    would be retried end skipped instead. Three requests in all, never a fourth."""
    settings = settings.model_copy(update={"lease_seconds": 60.0, "http_timeout_seconds": 10.0})
    partner.state.rules["slow"] = partner_mod.PathRule(status=503, delay_seconds=3.0)
    await rs.load(pool, [rs.line(f"s{i}", partner.url("slow")) for i in range(3)])
    assert (await rs.relay(settings, "publish")).code == 0
    run_id = await _run_of(pool, "s")
    log = tmp_path / "consumer.log"
    consumer = await rs.start_consumer(settings, log)
    try:

        async def on_the_wire() -> bool:
            return len(partner.state.arrivals) == 3

        await rs.wait_for(on_the_wire, 60, "three requests at the partner", interval=0.02)
        result = await rs.relay(settings, "runs", "cancel", str(run_id), "--apply", "--json")
        assert result.code == 0, result.stderr
        out = json.loads(result.stdout)
        assert (out["claimed_stopped"], out["on_the_wire"]) == (0, 3)
        assert (out["wire_outcomes"], out["in_flight"]) == ({"skipped": 3}, 0)
        assert await _states(pool, run_id) == {("skipped", "cancelled"): 3}
        # Their retry messages come back: each finds its row final (or, claimed before the
        # command's second pass, is stopped by the claim itself).

        async def retries_settled() -> bool:
            return await _events(log, "duplicate") + await _events(log, "skipped") >= 3

        await rs.wait_for(retries_settled, 60, "the retries settled")
    finally:
        await _stop(consumer)

    assert sum(partner.state.requests_by_path.values()) == 3
    recorded = await pool.fetchrow("SELECT on_the_wire, wire_outcomes FROM run_actions")
    assert tuple(recorded) == (3, {"skipped": 3})
    failed = await pool.fetchval(
        "SELECT count(*) FROM delivery_attempts WHERE outcome = 'retry' AND http_status = 503"
    )
    assert failed == 3
    assert _error_lines(log) == []


@pytest.mark.timeout(240)
async def test_dead_letter_without_waiting_kills_the_wire_rows_when_they_come_back(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    """`--no-wait`: the command returns while three requests are on the wire (it says so).
    Each fails (503); its retry message is claimed again, and the claim itself reads the
    operator's stop: dead, its dead letter published once, no second request."""
    settings = settings.model_copy(update={"lease_seconds": 60.0, "http_timeout_seconds": 10.0})
    partner.state.rules["slow"] = partner_mod.PathRule(status=503, delay_seconds=3.0)
    await rs.load(pool, [rs.line(f"n{i}", partner.url("slow")) for i in range(3)])
    assert (await rs.relay(settings, "publish")).code == 0
    run_id = await _run_of(pool, "n")
    log = tmp_path / "consumer.log"
    consumer = await rs.start_consumer(settings, log)
    try:

        async def on_the_wire() -> bool:
            return len(partner.state.arrivals) == 3

        await rs.wait_for(on_the_wire, 60, "three requests at the partner", interval=0.02)
        result = await rs.relay(
            settings, "runs", "dead-letter", str(run_id), "--apply", "--no-wait", "--reason", "x"
        )
        assert result.code == 0, result.stderr
        assert "0 rows dead" in result.stdout and "3 on the wire at the commit" in result.stdout
        assert "not waited for (--no-wait)" in result.stdout

        async def killed() -> bool:
            dead = (await _states(pool, run_id)).get(("dead", None), 0)
            return dead == 3 and await broker.dead_count(settings) >= 3

        await rs.wait_for(killed, 60, "the three dead and dead-lettered")
    finally:
        await _stop(consumer)

    assert sum(partner.state.requests_by_path.values()) == 3
    attempts = await pool.fetch(
        "SELECT attempt, outcome, error FROM delivery_attempts ORDER BY delivery_id, attempt"
    )
    assert Counter((a["attempt"], a["outcome"]) for a in attempts) == {
        (1, "retry"): 3,
        (2, "skipped"): 3,
    }
    letters = await broker.read(settings, broker.topology(settings).dead_queue, remove=False)
    assert len(letters) == 3 and len({m.headers["x-relay-delivery-id"] for m in letters}) == 3
    stopped = await pool.fetchval(
        "SELECT count(*) FROM deliveries WHERE stop_action_id IS NOT NULL"
    )
    assert stopped == 0  # final rows keep no stop mark
    assert _error_lines(log) == []
