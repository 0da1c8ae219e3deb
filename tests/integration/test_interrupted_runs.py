"""A publish run that does not finish says so: its record never stays ``running`` for ever.

- Killed (SIGKILL at a named point, as an OOM kill or a lost node would): the next
  run finds no session holding the killed run's lock, marks it ``interrupted``, and
  publishes the rows it left pending.
- Alive (its session holds the lock): another run leaves its record alone. A run whose
  lock's connection alone was lost (its backend terminated, as an idle-session timeout
  would) and which a run starting meanwhile marked ``interrupted`` takes the lock again
  at its next batch, is ``running`` again, and records its own end.
- Stopped (SIGTERM while its admission waits on a lock): it records ``interrupted`` with
  its counts and exits 1; the admission it was in rolled back, and the next run admits it.
  A backfill stopped by Ctrl-C or SIGTERM records ``interrupted``, not ``ok``, says so
  and exits 1.

Real ``relay publish`` processes against the shared PostgreSQL and RabbitMQ.
"""

from __future__ import annotations

import asyncio
import signal
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from service.ledger import publish_runs
from service.settings import Settings
from tests.support import forked
from tests.support import relay as rs
from tests.support.relay import RunningPartner

ROWS = 20


async def _runs(pool: asyncpg.Pool) -> list[tuple[str, bool, str | None]]:
    rows = await pool.fetch("SELECT status, finished_at, error FROM publish_runs ORDER BY id")
    return [(r["status"], r["finished_at"] is not None, r["error"]) for r in rows]


async def test_a_run_killed_after_admitting_is_marked_interrupted_and_its_rows_published(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line(f"k{i}", partner.url()) for i in range(ROWS)])
    killed = await rs.relay(settings, "publish", CRASH_AT="publish_after_admit")
    assert killed.code == -signal.SIGKILL, killed.stdout + killed.stderr[-2000:]
    assert await _runs(pool) == [("running", False, None)]
    assert await rs.states(pool) == {"pending": ROWS}

    after = await rs.relay(settings, "publish")
    assert after.code == 0, after.stdout + after.stderr[-2000:]
    assert f"published={ROWS} " in after.stdout, after.stdout
    (killed_run, error), next_run = [(r[0], r[2]) for r in await _runs(pool)]
    assert killed_run == "interrupted" and error is not None and "ended before" in error
    assert next_run == ("ok", None)
    marked = rs.log_events(after.stderr, "run_interrupted")
    first_id = await pool.fetchval("SELECT min(id) FROM publish_runs")
    assert [e["run_id"] for e in marked] == [first_id]
    assert await rs.states(pool) == {"queued": ROWS}


async def test_a_run_whose_session_lives_is_left_running_until_that_session_ends(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    """Another process's run in progress (its record made by the same function, its
    session holding the lock) is not taken for a killed one."""
    elsewhere = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        live = await publish_runs.start(elsewhere, "publish", datetime.now(UTC), "elsewhere")
        await rs.load(pool, [rs.line("l0", partner.url())])
        during = await rs.relay(settings, "publish")
        assert during.code == 0, during.stdout + during.stderr[-2000:]
        assert rs.log_events(during.stderr, "run_interrupted") == []
        status = await pool.fetchval("SELECT status FROM publish_runs WHERE id = $1", live.run_id)
        assert status == "running"
    finally:
        await elsewhere.close()  # the process "dies": its session and its lock go

    after = await rs.relay(settings, "publish")
    assert after.code == 0, after.stdout + after.stderr[-2000:]
    assert [e["run_id"] for e in rs.log_events(after.stderr, "run_interrupted")] == [live.run_id]
    statuses = [status for status, _, _ in await _runs(pool)]
    assert statuses == ["interrupted", "ok", "ok"]


async def test_a_run_whose_lock_connection_is_lost_takes_the_lock_again_and_records_its_end(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line(f"c{i}", partner.url()) for i in range(ROWS)])
    timeouts = {"database_command_timeout_seconds": 120.0, "publish_batch_size": 5}
    env = rs.env_for(settings.model_copy(update=timeouts))
    blocker = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        locked = blocker.transaction()
        await locked.start()
        await blocker.execute("LOCK TABLE deliveries IN EXCLUSIVE MODE")
        run = await forked.spawn(["publish"], env, stdout=forked.PIPE, stderr=forked.PIPE)
        await rs.wait_for(lambda: _inserts_wait(pool), 60, "relay publish waiting to insert")
        run_id = await pool.fetchval("SELECT id FROM publish_runs")
        sessions = await pool.fetchval(_LOCK_SESSIONS.format("count(pg_terminate_backend(pid))"))
        assert sessions == 1, "the run's lock is held by one session"
        await rs.wait_for(lambda: _no_lock_held(pool), 30, "the terminated session gone")
        # A run starting meanwhile finds the run without its lock.
        rescue = await rs.relay(settings, "rescue")
        assert rescue.code == 0, rescue.stdout + rescue.stderr[-2000:]
        assert [e["run_id"] for e in rs.log_events(rescue.stderr, "run_interrupted")] == [run_id]
        await locked.rollback()
        out, err = (b.decode() for b in await asyncio.wait_for(run.communicate(), 60))
    finally:
        await blocker.close()
    assert run.returncode == 0, out + err[-2000:]
    assert f"created={ROWS} " in out and f"published={ROWS} " in out, out
    assert await _runs(pool) == [("ok", True, None), ("ok", True, None)]  # it, the rescue
    retaken = rs.log_events(err, "run_lock_retaken")
    assert [(e["run_id"], e["revived"]) for e in retaken] == [(run_id, True)]
    assert await _no_lock_held(pool), "the run let its lock go at its end"
    assert await rs.states(pool) == {"queued": ROWS}


async def test_a_run_stopped_by_sigterm_records_interrupted_and_the_next_admits_its_rows(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line(f"t{i}", partner.url()) for i in range(ROWS)])
    # SIGTERM mid-admission: its transaction waits to insert.
    sigterm = signal.SIGTERM
    code, out, err = await _signalled_while_inserts_wait(settings, pool, ["publish"], sigterm)
    assert code == 1, out + err[-2000:]
    assert " interrupted: " in out and "created=0 " in out, out
    assert [e["event"] for e in rs.log_events(err, "publish_run_stopped")]
    assert await _runs(pool) == [("interrupted", True, "stopped by a signal before it finished")]
    assert await rs.states(pool) == {}  # the admission it was in rolled back

    after = await rs.relay(settings, "publish")
    assert after.code == 0, after.stdout + after.stderr[-2000:]
    assert f"created={ROWS} " in after.stdout and f"published={ROWS} " in after.stdout
    assert rs.log_events(after.stderr, "run_interrupted") == []  # it recorded its own end
    assert await rs.states(pool) == {"queued": ROWS}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
async def test_a_backfill_stopped_by_a_signal_records_interrupted_and_says_so(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, sig: signal.Signals
) -> None:
    await rs.load(pool, [rs.line("every-minute", partner.url(), cron="* * * * *")])
    since = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    args = ["backfill", "--reminder", "every-minute", "--from", since, "--apply"]
    code, out, err = await _signalled_while_inserts_wait(settings, pool, args, sig)
    assert code == 1, out + err[-2000:]
    assert "interrupted by a signal" in out and "(new 0, " in out, out
    assert await _runs(pool) == [("interrupted", True, None)]
    assert await rs.states(pool) == {}

    again = await rs.relay(settings, *args)
    assert again.code == 0, again.stdout + again.stderr[-2000:]
    statuses = [status for status, _, _ in await _runs(pool)]
    assert statuses == ["interrupted", "ok"]
    assert sum((await rs.states(pool)).values()) >= 5  # the window's occurrences, admitted


async def _signalled_while_inserts_wait(
    settings: Settings, pool: asyncpg.Pool, args: list[str], sig: signal.Signals
) -> tuple[int, str, str]:
    """Run ``relay ARGS`` while someone else holds the ledger (reads go on, inserts wait):
    once the run is recorded and its insert waits, send ``sig``; its code, stdout, stderr."""
    env = rs.env_for(settings.model_copy(update={"database_command_timeout_seconds": 120.0}))
    blocker = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        locked = blocker.transaction()
        await locked.start()
        await blocker.execute("LOCK TABLE deliveries IN EXCLUSIVE MODE")
        run = await forked.spawn(args, env, stdout=forked.PIPE, stderr=forked.PIPE)
        await rs.wait_for(lambda: _inserts_wait(pool), 60, f"relay {args[0]} waiting to insert")
        assert await _runs(pool) == [("running", False, None)]
        run.send_signal(sig)
        out, err = await asyncio.wait_for(run.communicate(), 60)
        await locked.rollback()
    finally:
        await blocker.close()
    assert run.returncode is not None
    return run.returncode, out.decode(), err.decode()


async def _inserts_wait(pool: asyncpg.Pool) -> bool:
    return bool(
        await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database() AND query ILIKE '%INSERT INTO deliveries%'"
        )
    )


# The sessions holding a publish run's lock (runs_interrupted's test, as SQL).
_LOCK_SESSIONS = (
    "SELECT {} FROM pg_locks WHERE locktype = 'advisory' AND classid = 72177028"
    " AND objsubid = 2 AND granted AND database = ("
    "SELECT oid FROM pg_database WHERE datname = current_database())"
)


async def _no_lock_held(pool: asyncpg.Pool) -> bool:
    return await pool.fetchval(_LOCK_SESSIONS.format("count(*)")) == 0
