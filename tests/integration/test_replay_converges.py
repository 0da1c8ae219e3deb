"""Replay converges: a queue replay is bounded by what the queue held when it began, a
ledger replay is safe beside running consumers, and the dry run reports exactly what
``--apply`` then does. Real ``relay`` processes, real consumers and servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import asyncpg
import pytest

from publisher import replay as replay_mod
from service import amqp, messages
from service.ops import partner as partner_mod
from service.ops.console import data as console_data
from service.settings import Settings
from tests.support import broker, forked
from tests.support import relay as rs
from tests.support.relay import RunningPartner

_NUMBERS = re.compile(
    r"selected=(\d+) (?:would replay|replayed)=(\d+) \(not dead: (\d+)\) stale=(\d+) "
    r"undecodable=(\d+) failed=(\d+)"
)


def _numbers(stdout: str) -> dict[str, int]:
    match = _NUMBERS.search(stdout)
    assert match, stdout
    names = ("selected", "replayed", "requeued", "stale", "undecodable", "failed")
    return dict(zip(names, map(int, match.groups()), strict=True))


async def _settled_dead(pool: asyncpg.Pool, n: int) -> bool:
    """n rows, every one dead with its dead letter confirmed, nothing else."""
    row = await pool.fetchrow(
        "SELECT count(*) FILTER (WHERE state = 'dead' AND dead_lettered_at IS NOT NULL) AS done,"
        " count(*) AS total FROM deliveries"
    )
    return bool(row["done"] == row["total"] == n)


async def _stop(consumers: list[forked.RelayProcess]) -> list[int]:
    for proc in consumers:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
    return [await asyncio.wait_for(p.wait(), 30) for p in consumers]


async def _kill(consumers: list[forked.RelayProcess]) -> None:
    for proc in consumers:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.timeout(240)
async def test_queue_replay_beside_a_consumer_replays_each_dead_row_once_and_exits(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    """The partner keeps rejecting, so every replayed delivery dies again at once and its
    new dead letter lands in the queue the replay is reading."""
    n = 15
    partner.state.rules["broken"] = partner_mod.PathRule(status=400)
    await rs.load(pool, [rs.line(f"r{i}", partner.url("broken")) for i in range(n)])
    assert (await rs.relay(settings, "publish")).code == 0
    consumer = await rs.start_consumer(settings, tmp_path / "consumer.log")
    try:
        await rs.wait_for(lambda: _settled_dead(pool, n), 60, "all dead and dead-lettered")
        assert await broker.dead_count(settings) == n

        result = await rs.relay(
            settings, "replay", "--from", "queue", "--apply", "--operator", "t", timeout=120
        )
        assert result.code == 0, result.stdout + result.stderr
        assert _numbers(result.stdout) == {
            "selected": n,
            "replayed": n,
            "requeued": 0,
            "stale": 0,
            "undecodable": 0,
            "failed": 0,
        }
        # The replayed deliveries die again; their new dead letters stay for the next replay.
        await rs.wait_for(lambda: _settled_dead(pool, n), 60, "replayed rows dead again")

        async def new_letters() -> bool:
            return await broker.dead_count(settings) == n

        await rs.wait_for(new_letters, 30, "one new dead letter per row")
        assert consumer.returncode is None
        assert await _stop([consumer]) == [0]
    finally:
        await _kill([consumer])

    rows = await pool.fetch("SELECT replays, attempts, round_start FROM deliveries")
    assert {tuple(r) for r in rows} == {(1, 2, 1)}  # one replay each, one attempt per round
    audit = await pool.fetch("SELECT source, selected, replayed FROM replays")
    assert [tuple(a) for a in audit] == [("dead-letter-queue", n, n)]
    assert partner.state.requests_by_path["broken"] == 2 * n
    letters = await broker.read(settings, broker.topology(settings).dead_queue, remove=False)
    assert sorted(m.headers["x-relay-attempts"] for m in letters) == [2] * n  # all new


@pytest.mark.timeout(420)
async def test_twenty_ledger_replays_beside_two_consumers_all_succeed_and_add_up(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    """300 rows that die at every attempt; 20 ledger replays, up to ten at once, while two
    consumers claim, fail and dead-letter the rows those replays reset."""
    n = 300
    # Every attempt must be a 400: a request timing out at the in-process partner on a
    # loaded machine (2 s) would add a retry and break the count below.
    settings = settings.model_copy(update={"http_timeout_seconds": 20.0, "lease_seconds": 60.0})
    partner.state.rules["broken"] = partner_mod.PathRule(status=400)
    await rs.load(pool, [rs.line(f"r{i}", partner.url("broken")) for i in range(n)])
    assert (await rs.relay(settings, "publish")).code == 0
    consumers = [await rs.start_consumer(settings, tmp_path / f"c{i}.log") for i in range(2)]
    results: list[rs.Result] = []
    try:
        await rs.wait_for(lambda: _settled_dead(pool, n), 90, "all dead", interval=0.5)
        for wave in (1, 2, 3, 4, 10):
            results += await asyncio.gather(
                *(
                    rs.relay(settings, "replay", "--from", "ledger", "--apply", timeout=180)
                    for _ in range(wave)
                )
            )
        assert len(results) == 20
        await rs.wait_for(lambda: _settled_dead(pool, n), 120, "all dead again", interval=0.5)
        assert all(p.returncode is None for p in consumers)
        assert await _stop(consumers) == [0, 0]
    finally:
        await _kill(consumers)

    failures = [r for r in results if r.code != 0 or "Traceback" in r.stderr]
    assert failures == [], [(r.code, r.stderr[-2000:]) for r in failures]
    assert not any("Deadlock" in r.stdout + r.stderr for r in results)
    numbers = [_numbers(r.stdout) for r in results]
    assert all(x["failed"] == 0 for x in numbers)
    # The ledger adds up: each reset is one replay of one row and one more attempt at it.
    total_replays = await pool.fetchval("SELECT sum(replays) FROM deliveries")
    assert total_replays == sum(x["replayed"] for x in numbers) > 0
    audit = await pool.fetchval("SELECT sum(replayed) FROM replays")
    assert audit == total_replays
    mismatched = await pool.fetchval(
        "SELECT count(*) FROM deliveries WHERE attempts <> replays + 1 OR round_start <> replays"
    )
    assert mismatched == 0, [
        tuple(r)
        for r in await pool.fetch(
            "SELECT id, attempts, replays, round_start FROM deliveries"
            " WHERE attempts <> replays + 1 OR round_start <> replays"
        )
    ]
    assert partner.state.requests_by_path["broken"] == n + total_replays


async def _mixed_dead_letter_queue(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> dict[str, list[int]]:
    """Three dead rows with their own dead letters; dead letters whose rows are delivered
    (2) or still queued (1); and one dead letter that is not a delivery message."""
    partner.state.rules["broken"] = partner_mod.PathRule(status=400)
    lines = [rs.line(f"dead{i}", partner.url("broken")) for i in range(3)]
    lines += [rs.line(f"done{i}", partner.url("ok")) for i in range(2)]
    await rs.load(pool, lines)
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _final(pool, 5), 30, "3 dead and 2 delivered")
        await rs.wait_for(lambda: _dead_letters_at_least(settings, 3), 30, "3 dead letters")
    await rs.load(pool, [rs.line("waiting", partner.url("ok"))])
    assert (await rs.relay(settings, "publish")).code == 0  # no consumer: it stays queued
    by_state: dict[str, list[int]] = {}
    for r in await pool.fetch("SELECT id, state::text AS state FROM deliveries ORDER BY id"):
        by_state.setdefault(r["state"], []).append(r["id"])
    assert {k: len(v) for k, v in by_state.items()} == {"dead": 3, "delivered": 2, "queued": 1}
    for delivery_id in by_state["delivered"] + by_state["queued"]:
        await broker.publish_dead(
            settings, messages.encode(delivery_id), {amqp.REASON_HEADER: "delivery_limit"}
        )
    await broker.publish_dead(settings, b"\x00 not a delivery", {amqp.REASON_HEADER: "x"})
    assert await broker.dead_count(settings) == 7
    return by_state


async def _final(pool: asyncpg.Pool, n: int) -> bool:
    counts = await rs.states(pool)
    return counts.get("dead", 0) + counts.get("delivered", 0) == n


async def _dead_letters_at_least(settings: Settings, n: int) -> bool:
    return await broker.dead_count(settings) >= n


async def _ledger_snapshot(pool: asyncpg.Pool) -> list[tuple[object, ...]]:
    rows = await pool.fetch("SELECT id, state::text, replays, attempts FROM deliveries ORDER BY id")
    return [tuple(r) for r in rows]


@pytest.mark.timeout(180)
async def test_queue_dry_run_reports_the_numbers_apply_then_reports(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    by_state = await _mixed_dead_letter_queue(settings, pool, partner)
    before = await _ledger_snapshot(pool)

    dry = await rs.relay(settings, "replay", "--from", "queue")
    assert dry.code == 0 and "dry run" in dry.stdout, dry.stdout + dry.stderr
    assert await _ledger_snapshot(pool) == before  # nothing changed
    assert await broker.dead_count(settings) == 7
    assert await broker.waiting(settings) == 1  # only the queued row's own message

    applied = await rs.relay(settings, "replay", "--from", "queue", "--apply")
    assert applied.code == 0, applied.stdout + applied.stderr
    expected = {
        "selected": 7,
        "replayed": 4,
        "requeued": 1,
        "stale": 2,
        "undecodable": 1,
        "failed": 0,
    }
    assert _numbers(dry.stdout) == expected
    assert _numbers(applied.stdout) == expected

    # What --apply did: the dead rows were reset and queued, the queued row republished,
    # the obsolete dead letters acked, the undecodable one left for a person.
    states = dict(
        (r["id"], r["state"])
        for r in await pool.fetch("SELECT id, state::text AS state FROM deliveries")
    )
    assert all(states[i] == "queued" for i in by_state["dead"] + by_state["queued"])
    left = await broker.read(settings, broker.topology(settings).dead_queue, remove=False)
    assert [m.body for m in left] == [b"\x00 not a delivery"]


@pytest.mark.timeout(180)
async def test_ledger_dry_run_reports_the_numbers_apply_then_reports(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await _mixed_dead_letter_queue(settings, pool, partner)
    args = ("replay", "--from", "ledger", "--state", "dead", "--state", "queued")
    dry = await rs.relay(settings, *args)
    applied = await rs.relay(settings, *args, "--apply")
    assert dry.code == applied.code == 0, dry.stderr + applied.stderr
    expected = {
        "selected": 4,
        "replayed": 4,
        "requeued": 1,
        "stale": 0,
        "undecodable": 0,
        "failed": 0,
    }
    assert _numbers(dry.stdout) == expected
    assert _numbers(applied.stdout) == expected


@pytest.mark.timeout(180)
async def test_a_dead_row_with_two_dead_letters_is_replayed_once_and_the_dry_run_agrees(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    """A row died, was replayed from the ledger (its dead letter stayed in the queue) and
    died again: two dead letters, one dead row. A queue replay must give it one new round
    and one message, and its dry run must say what --apply then does."""
    partner.state.rules["broken"] = partner_mod.PathRule(status=400)
    await rs.load(pool, [rs.line("twice", partner.url("broken"))])
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _settled_dead(pool, 1), 30, "dead")
        again = await rs.relay(settings, "replay", "--from", "ledger", "--apply")
        assert again.code == 0 and "replayed=1" in again.stdout, again.stdout
        await rs.wait_for(lambda: _dead_letters_at_least(settings, 2), 30, "second death")
        await rs.wait_for(lambda: _settled_dead(pool, 1), 30, "dead again")
    assert await broker.dead_count(settings) == 2

    dry = await rs.relay(settings, "replay", "--from", "queue")
    applied = await rs.relay(settings, "replay", "--from", "queue", "--apply")
    assert dry.code == applied.code == 0, dry.stderr + applied.stderr

    row = await pool.fetchrow("SELECT state::text AS state, replays FROM deliveries")
    assert (row["state"], row["replays"]) == ("queued", 2)  # one more round, not two
    dry_numbers, apply_numbers = _numbers(dry.stdout), _numbers(applied.stdout)
    waiting = await broker.waiting(settings)
    # One replay per dead row: the second dead letter is obsolete once the first was
    # replayed by this same run; and the dry run says what --apply does.
    assert (dry_numbers == apply_numbers, waiting) == (True, 1), (dry_numbers, apply_numbers)


@contextlib.asynccontextmanager
async def _replay_waiting_on_its_second_page(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> AsyncIterator[forked.RelayProcess]:
    """Two pages of dead rows and ``relay replay --from ledger --apply`` on them, yielded
    once its first page is replayed and its second page's reset waits on a row the test
    holds (the row is let go when the block ends)."""
    partner.state.rules["broken"] = partner_mod.PathRule(status=400)
    n = replay_mod.PAGE + 100
    await rs.load(pool, [rs.line(f"d{i}", partner.url("broken")) for i in range(n)])
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _settled_dead(pool, n), 90, "all dead", interval=0.5)
    env = rs.env_for(settings.model_copy(update={"database_command_timeout_seconds": 120.0}))
    holder = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute(
            "SELECT id FROM deliveries WHERE id = (SELECT max(id) FROM deliveries) FOR UPDATE"
        )
        args = ["replay", "--from", "ledger", "--apply", "--operator", "ops"]
        replay = await forked.spawn(args, env, stdout=forked.PIPE, stderr=forked.PIPE)

        async def second_page_waits() -> bool:
            waiting = await rs.lock_waiters(pool)
            return bool(waiting) and (await rs.states(pool)).get("queued") == replay_mod.PAGE

        await rs.wait_for(second_page_waits, 60, "the second page's reset waiting")
        try:
            yield replay
        finally:
            if replay.returncode is None:
                replay.kill()
                await replay.wait()
            await held.rollback()
    finally:
        await holder.close()


async def test_a_ledger_replay_stopped_by_sigterm_records_what_it_did_and_that_it_was_stopped(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    """Two pages of dead rows; the second page's reset waits on a row someone holds, and
    SIGTERM comes then. The first page stays replayed, the second dead; the audit row and
    the summary both say 500 replayed and interrupted (before: killed, 0 and never ended)."""
    async with _replay_waiting_on_its_second_page(settings, pool, partner) as replay:
        replay.send_signal(signal.SIGTERM)
        out, err = (b.decode() for b in await asyncio.wait_for(replay.communicate(), 60))
    assert replay.returncode == 1, out + err[-2000:]
    assert _numbers(out)["replayed"] == replay_mod.PAGE and "interrupted by a signal" in out, out
    audit = await pool.fetchrow(
        "SELECT selected, replayed, interrupted, finished_at IS NOT NULL AS ended FROM replays"
    )
    assert audit is not None
    assert (audit["replayed"], audit["interrupted"], audit["ended"]) == (
        replay_mod.PAGE,
        True,
        True,
    )
    assert await rs.states(pool) == {"queued": replay_mod.PAGE, "dead": 100}


async def test_a_killed_ledger_replay_leaves_its_counts_so_far_and_the_console_says_killed(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    """The same replay, SIGKILLed while its second page waits. While it runs, the console
    shows it running with its first page's counts; once its process is gone, it shows it
    killed with those counts (before: 0 selected, 0 replayed, "not finished" for ever)."""
    async with _replay_waiting_on_its_second_page(settings, pool, partner) as replay:
        [running] = (await console_data.dead(pool, None, None))["replays"]
        replay.kill()
        await replay.wait()

    async def shown() -> dict[str, Any]:
        [replay_row] = (await console_data.dead(pool, None, None))["replays"]
        return cast(dict[str, Any], replay_row)

    async def seen_killed() -> bool:
        return bool((await shown())["killed"])

    await rs.wait_for(seen_killed, 30, "the replay shown as killed")
    killed = await shown()
    assert (running["killed"], running["selected"], running["replayed"]) == (
        False,
        replay_mod.PAGE,
        replay_mod.PAGE,
    )
    assert (killed["selected"], killed["replayed"], killed["finished_at"]) == (
        replay_mod.PAGE,
        replay_mod.PAGE,
        None,
    )
    # The killed process's waiting reset still runs once the row is let go (PostgreSQL does
    # not notice a vanished client during a lock wait, unless client_connection_check_
    # interval is set): its rows are then pending, for the next publish run to send.
    left = await rs.states(pool)
    assert left in (
        {"queued": replay_mod.PAGE, "dead": 100},
        {"queued": replay_mod.PAGE, "pending": 100},
    )
