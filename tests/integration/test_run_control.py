"""Per-run control through the real `relay runs` CLI against real servers: a held run's
rows are parked without an attempt until released; cancel skips and dead-letter kills the
rows not final; every action is a dry run unless --apply, idempotent, and recorded where
`relay status --run` shows it."""

from __future__ import annotations

import json

import asyncpg

from service.settings import Settings
from tests.support import relay as rs
from tests.support.relay import RunningPartner


async def _ok(settings: Settings, *args: str) -> str:
    result = await rs.relay(settings, *args)
    assert result.code == 0, (args, result.stdout, result.stderr)
    return result.stdout


async def _run_of(pool: asyncpg.Pool, prefix: str) -> int:
    run_id: int = await pool.fetchval(
        "SELECT DISTINCT run_id FROM deliveries WHERE reminder_id LIKE $1", prefix + "%"
    )
    return run_id


async def _states(pool: asyncpg.Pool, run_id: int) -> dict[str, int]:
    rows = await pool.fetch(
        "SELECT state::text AS s, count(*) AS n FROM deliveries WHERE run_id = $1 GROUP BY 1",
        run_id,
    )
    return {r["s"]: r["n"] for r in rows}


async def test_hold_parks_a_run_without_attempts_until_release(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line(f"held{i}", partner.url()) for i in range(4)])
    await _ok(settings, "publish")
    run_id = await _run_of(pool, "held")

    dry = await _ok(settings, "runs", "hold", str(run_id), "--reason", "portal down")
    assert f"run {run_id} would be held: 4 rows" in dry and "dry run" in dry
    assert await pool.fetchval("SELECT held_at FROM publish_runs WHERE id = $1", run_id) is None
    held = await _ok(
        settings,
        "runs",
        "hold",
        str(run_id),
        "--reason",
        "portal down",
        "--apply",
        "--operator",
        "ana",
    )
    assert f"run {run_id} held" in held and "4 rows" in held
    again = await _ok(settings, "runs", "hold", str(run_id), "--apply")
    assert "already held: nothing to do" in again

    consumer_settings = settings.model_copy(update={"run_hold_recheck_seconds": 1.0})
    async with rs.consumer_in_process(consumer_settings):

        async def parked() -> bool:
            states = await _states(pool, run_id)
            return states == {"retrying": 4}

        await rs.wait_for(parked, 20, "every row parked")
        # Parked, never attempted: no attempt counted, no request made.
        assert await pool.fetchval("SELECT sum(attempts) FROM deliveries") == 0
        assert await pool.fetchval("SELECT count(*) FROM delivery_attempts") == 0
        assert partner.state.events == {}
        listed = json.loads(await _ok(settings, "runs", "list", "--json"))["runs"]
        assert [(r["run_id"], r["held"], r["pending"]) for r in listed] == [(run_id, True, 4)]

        released = await _ok(
            settings,
            "runs",
            "release",
            str(run_id),
            "--reason",
            "portal up",
            "--apply",
            "--operator",
            "ana",
        )
        assert f"run {run_id} released" in released

        async def delivered() -> bool:
            return await _states(pool, run_id) == {"delivered": 4}

        await rs.wait_for(delivered, 30, "delivered after the release")
    assert await pool.fetchval("SELECT count(*) FROM delivery_attempts") == 4
    assert len(partner.state.accepted) == 4

    report = json.loads(await _ok(settings, "status", "--run", str(run_id), "--json"))
    actions = report["runs"][0]["actions"]
    assert [(a["action"], a["operator"], a["reason"], a["rows"]) for a in actions] == [
        ("hold", "ana", "portal down", 4),
        ("release", "ana", "portal up", 4),
    ]
    text = await _ok(settings, "status", "--run", str(run_id))
    assert "hold by ana: 4 rows (portal down)" in text
    assert "release by ana: 4 rows (portal up)" in text


async def test_cancel_skips_and_dead_letter_kills_the_rows_not_final_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line(f"c{i}", partner.url()) for i in range(3)])
    await _ok(settings, "publish")
    cancel_run = await _run_of(pool, "c")
    await rs.load(pool, [rs.line(f"d{i}", partner.url()) for i in range(2)])
    await _ok(settings, "publish")
    dead_run = await _run_of(pool, "d")

    dry = json.loads(await _ok(settings, "runs", "cancel", str(cancel_run), "--json"))
    assert (dry["applied"], dry["changed"], dry["rows"]) == (False, True, 3)
    assert await _states(pool, cancel_run) == {"queued": 3}
    await _ok(settings, "runs", "cancel", str(cancel_run), "--reason", "sent by hand", "--apply")
    skipped = await pool.fetch(
        "SELECT DISTINCT state::text AS s, skip_reason FROM deliveries WHERE run_id = $1",
        cancel_run,
    )
    assert [(r["s"], r["skip_reason"]) for r in skipped] == [("skipped", "cancelled")]
    twice = await _ok(settings, "runs", "cancel", str(cancel_run), "--apply")
    assert "has no rows to move: nothing to do" in twice

    out = await _ok(
        settings, "runs", "dead-letter", str(dead_run), "--reason", "bad template", "--apply"
    )
    assert f"run {dead_run} dead-lettered" in out and "2 rows" in out
    assert await _states(pool, dead_run) == {"dead": 2}
    errors = await pool.fetch(
        "SELECT DISTINCT last_error FROM deliveries WHERE run_id = $1", dead_run
    )
    assert [r["last_error"] for r in errors] == ["dead-lettered by an operator: bad template"]
    recorded = await pool.fetch("SELECT run_id, action, rows FROM run_actions ORDER BY id")
    assert [tuple(r) for r in recorded] == [(cancel_run, "cancel", 3), (dead_run, "dead-letter", 2)]

    # Dead is replayable: a ledger replay of the run and a consumer deliver them.
    replay = await _ok(settings, "replay", "--from", "ledger", "--run", str(dead_run), "--apply")
    assert "replayed=2" in replay
    async with rs.consumer_in_process(settings):

        async def delivered() -> bool:
            return await _states(pool, dead_run) == {"delivered": 2}

        await rs.wait_for(delivered, 30, "replayed rows delivered")
    assert await _states(pool, cancel_run) == {"skipped": 3}
    assert not any(k.startswith("reminder:c") for k in partner.state.accepted)
    missing = await rs.relay(settings, "runs", "hold", "999999", "--apply")
    assert missing.code == 1 and "no run 999999" in missing.stderr
