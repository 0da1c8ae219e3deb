"""Operators in control, through the real `relay` CLI against real servers: one delivery's
story, listings with --json, per-run hold/release/cancel/dead-letter, pauses that skip,
backfill on purpose, a report that counts outbox intents, dropping dead letters, and
progress on a terminal."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import signal
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import aio_pika
import asyncpg
from aio_pika.abc import AbstractChannel

from service import amqp, messages, outbox
from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import broker, forked
from tests.support import relay as rs
from tests.support.relay import RunningPartner


async def _ok(settings: Settings, *args: str, **env: str) -> str:
    result = await rs.relay(settings, *args, **env)
    assert result.code == 0, (args, result.stdout, result.stderr)
    return result.stdout


async def _json(settings: Settings, *args: str) -> dict:  # type: ignore[type-arg]
    data: dict = json.loads(await _ok(settings, *args, "--json"))  # type: ignore[type-arg]
    return data


async def _settled(pool: asyncpg.Pool, **expected: int) -> bool:
    states = await rs.states(pool)
    return all(states.get(k, 0) == v for k, v in expected.items())


async def test_deliveries_show_tells_one_delivery_story_and_list_filters_and_pages(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    partner.state.rules["bad"] = partner_mod.PathRule(status=400)
    partner.state.rules["flaky"] = partner_mod.PathRule(status=503, first_n_per_key=1)
    lines = [rs.line(f"ok{i}", partner.url("ok")) for i in range(3)]
    lines += [rs.line("bad1", partner.url("bad")), rs.line("flaky1", partner.url("flaky"))]
    await rs.load(pool, lines)
    await _ok(settings, "publish")
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _settled(pool, delivered=4, dead=1), 60, "settled")
    bad = await pool.fetchrow(
        "SELECT id, idempotency_key, run_id FROM deliveries WHERE reminder_id = 'bad1'"
    )
    assert bad is not None

    text = await _ok(settings, "deliveries", "show", str(bad["id"]))
    assert f"delivery {bad['id']}" in text and "dead" in text and "rejected" in text
    assert "reminder         bad1" in text and f"run              {bad['run_id']}" in text
    # The webhook destination is its scheme and host only: never the path or the payload.
    assert f"http://127.0.0.1:{partner.port}" in text and "/hooks/bad" not in text
    assert "hello bad1" not in text

    story = await _json(settings, "deliveries", "show", "--key", bad["idempotency_key"])
    assert (story["id"], story["state"], story["reminder"]["id"]) == (bad["id"], "dead", "bad1")
    assert [(a["attempt"], a["outcome"], a["http_status"]) for a in story["attempt_history"]] == [
        (1, "rejected", 400)
    ]
    assert story["attempt_history"][0]["duration_ms"] is not None
    flaky = await pool.fetchval("SELECT id FROM deliveries WHERE reminder_id = 'flaky1'")
    flaky_story = await _json(settings, "deliveries", "show", str(flaky))
    assert [a["outcome"] for a in flaky_story["attempt_history"]] == ["retry", "accepted"]
    missing = await rs.relay(settings, "deliveries", "show", "999999")
    assert missing.code == 1 and "no delivery" in missing.stderr

    dead = await _json(settings, "deliveries", "list", "--state", "dead")
    assert [d["reminder_id"] for d in dead["deliveries"]] == ["bad1"]
    by_run = await _json(settings, "deliveries", "list", "--run", str(bad["run_id"]))
    assert len(by_run["deliveries"]) == 5 and by_run["next_before"] is None
    by_dest = await _json(settings, "deliveries", "list", "--destination", partner.url("flaky"))
    assert [d["reminder_id"] for d in by_dest["deliveries"]] == ["flaky1"]
    assert (await _json(settings, "deliveries", "list", "--channel", "sms"))["deliveries"] == []
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert (await _json(settings, "deliveries", "list", "--since", future))["deliveries"] == []
    assert len((await _json(settings, "deliveries", "list", "--until", future))["deliveries"]) == 5
    # Paging: newest first, two at a time, every row once.
    seen: list[int] = []
    before: list[str] = []
    while True:
        page = await _json(settings, "deliveries", "list", "--limit", "2", *before)
        seen += [d["id"] for d in page["deliveries"]]
        if page["next_before"] is None:
            break
        before = ["--before", str(page["next_before"])]
    assert seen == sorted(seen, reverse=True) and len(set(seen)) == 5
    table = await _ok(settings, "deliveries", "list", "--reminder", "bad1")
    assert "bad1" in table and "ok1" not in table
    bad_state = await rs.relay(settings, "deliveries", "list", "--state", "lost")
    assert bad_state.code == 2 and "--state" in bad_state.stderr


async def test_paused_occurrences_are_skipped_and_backfill_admits_them_once_on_purpose(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    start = datetime.now(UTC)
    # One due before the pause, and one that falls due while admission is paused.
    await rs.load(pool, [rs.line("before", partner.url(), due_at=start - timedelta(minutes=1))])
    await _ok(settings, "pause")
    paused_at = await pool.fetchval("SELECT paused_at FROM admission_pauses")
    due = max(datetime.now(UTC), paused_at) + timedelta(seconds=0.5)
    await rs.load(pool, [rs.line("during", partner.url(), due_at=due)])
    assert "admission PAUSED" in await _ok(settings, "status")
    await asyncio.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds()) + 0.2)
    await _ok(settings, "resume")
    await _ok(settings, "publish")
    rows = {
        r["reminder_id"]: (r["state"], r["skip_reason"])
        for r in await pool.fetch(
            "SELECT reminder_id, state::text AS state, skip_reason FROM deliveries"
        )
    }
    # Due before the pause: the missed-fire policy's business (sent). During: skipped.
    assert rows == {"during": ("skipped", "paused"), "before": ("queued", None)}
    report = await _json(settings, "status")
    assert report["runs"][0]["skipped_by_reason"] == {"paused": 1}
    await _ok(settings, "publish")  # resume does not replay
    assert await pool.fetchval("SELECT count(*) FROM deliveries") == 2

    window = ("--from", (start - timedelta(minutes=5)).isoformat())
    dry = await _json(settings, "backfill", "--reminder", "during", *window)
    assert (dry["apply"], dry["in_window"], dry["reopened"], dry["new"]) == (False, 1, 1, 0)
    assert (
        await pool.fetchval("SELECT state::text FROM deliveries WHERE reminder_id = 'during'")
        == "skipped"
    )
    done = await _json(settings, "backfill", "--reminder", "during", *window, "--apply")
    assert (done["reopened"], done["new"], done["run_id"] is not None) == (1, 0, True)
    again = await _json(settings, "backfill", "--reminder", "during", *window, "--apply")
    assert (again["reopened"], again["new"], again["already"], again["run_id"]) == (0, 0, 1, None)
    row = await pool.fetchrow(
        "SELECT d.state::text AS state, p.kind FROM deliveries d JOIN publish_runs p"
        " ON p.id = d.run_id WHERE reminder_id = 'during'"
    )
    assert (row["state"], row["kind"]) == ("pending", "backfill")
    await _ok(settings, "publish")  # the next publish run's sweep sends it
    assert (
        await pool.fetchval("SELECT state::text FROM deliveries WHERE reminder_id = 'during'")
        == "queued"
    )


async def test_backfill_admits_the_occurrences_the_ledger_lacks_and_publishes_at_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(pool, [rs.line("every-minute", partner.url(), cron="* * * * *")])
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    window = (
        "--from",
        (now - timedelta(minutes=4, seconds=30)).isoformat(),
        "--to",
        (now - timedelta(seconds=30)).isoformat(),
    )
    dry = await _ok(settings, "backfill", "--all", *window)
    assert "would admit=4 (new 4" in dry and "dry run" in dry
    done = await _json(settings, "backfill", "--all", *window, "--apply", "--publish")
    assert (done["new"], done["published"], done["failed"]) == (4, 4, 0)
    states = await pool.fetch("SELECT state::text AS s, occurrence_at FROM deliveries ORDER BY 2")
    assert [r["s"] for r in states] == ["queued"] * 4
    assert [r["occurrence_at"] for r in states] == [
        now - timedelta(minutes=m) for m in (4, 3, 2, 1)
    ]
    again = await _json(settings, "backfill", "--all", *window, "--apply", "--publish")
    assert (again["new"], again["reopened"], again["already"]) == (0, 0, 4)
    assert (again["run_id"], again["published"], again["interrupted"]) == (None, 0, False)
    runs = await _json(settings, "runs", "list")
    assert [(r["kind"], r["owed"]) for r in runs["runs"]] == [("backfill", 4)]
    missing = await rs.relay(settings, "backfill", "--reminder", "nope", *window)
    assert missing.code == 2 and "no reminder" in missing.stderr


async def test_status_counts_outbox_intents_and_completion_is_delivered_over_owed(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    partner.state.rules["bad"] = partner_mod.PathRule(status=400)
    lines = [rs.line(f"ok{i}", partner.url()) for i in range(3)]
    lines += [rs.line("gone", partner.url())]
    await rs.load(pool, lines)
    await _ok(settings, "publish")
    await _ok(settings, "reminders", "cancel", "gone")  # its queued send will be skipped
    async with pool.acquire() as conn, conn.transaction():
        await outbox.add_intent(
            conn,
            key="order-7",
            channel="webhook",
            destination=partner.url("bad"),
            payload={"text": "order 7"},
            allow_networks=rs.LOOPBACK,
        )
    await _ok(settings, "publish")
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _settled(pool, delivered=3, skipped=1, dead=1), 60, "settled")
    run_id = await pool.fetchval("SELECT min(id) FROM publish_runs")
    missing = await _json(settings, "status", "--missing", "--run", str(run_id))
    assert [m["reminder_id"] for m in missing["missing"]] == ["gone"]
    assert [(m["idempotency_key"], m["state"]) for m in missing["outbox_missing"]] == [
        ("outbox:order-7", "dead")
    ]
    intent = await _json(settings, "deliveries", "show", "--key", "outbox:order-7")
    assert intent["intent"] == {"source": "outbox", "key": "outbox:order-7"}
    assert intent["reminder"] is None and intent["run"] is None
    assert intent["destination"] == f"http://127.0.0.1:{partner.port}"
    text = await _ok(settings, "status", "--missing", "--run", str(run_id))
    assert "outbox intents (no run): 1 not delivered" in text
    run = (await _json(settings, "status", "--run", str(run_id)))["runs"][0]
    assert (run["owed"], run["delivered"], run["completion_ratio"]) == (4, 3, 0.75)
    assert run["by_channel"]["webhook"] == {
        "owed": 4,
        "delivered": 3,
        "skipped": 1,
        "dead": 0,
        "pending": 0,
        "completion_ratio": 0.75,
    }
    table = await _ok(settings, "status", "--run", str(run_id))
    assert "webhook: delivered 3/4 (75.0%), skipped 1, dead 0, pending 0" in table


async def test_replay_drop_acknowledges_undecodable_and_unknown_dead_letters_only(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    partner.state.rules["bad"] = partner_mod.PathRule(status=400)
    await rs.load(pool, [rs.line("bad1", partner.url("bad"))])
    await _ok(settings, "publish")
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _settled(pool, dead=1), 60, "dead")
    topology = amqp.Topology.from_settings(settings)
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        channel = await connection.channel()
        depth = await _dead_letters(channel, topology, b"not json at all", messages.encode(987654))
        await rs.wait_for(lambda: _eq(depth, 3), 10, "three dead letters")
        dry = await _json(settings, "replay", "--drop")
        assert (dry["dropped"], dry["undecodable"], dry["unknown"], dry["kept"]) == (2, 1, 1, 1)
        assert await depth() == 3
        done = await _ok(settings, "replay", "--drop", "--apply", "--operator", "ana")
        assert "dropped=2" in done
        await rs.wait_for(lambda: _eq(depth, 1), 10, "one dead letter left")
        audit = await pool.fetchrow("SELECT source, operator, selected, dropped FROM replays")
        assert tuple(audit) == ("drop", "ana", 3, 2)
        # With a filter, the real one matches too.
        run_id = await pool.fetchval("SELECT run_id FROM deliveries")
        matched = await _json(settings, "replay", "--drop", "--run", str(run_id))
        assert (matched["matched"], matched["dropped"]) == (1, 1)
    ledger_drop = await rs.relay(settings, "replay", "--from", "ledger", "--drop")
    assert ledger_drop.code == 2


async def _eq(probe, expected: int) -> bool:  # type: ignore[no-untyped-def]
    return bool(await probe() == expected)


async def _dead_letters(
    channel: AbstractChannel, topology: amqp.Topology, *bodies: bytes
) -> Callable[[], Awaitable[int]]:
    """Put ``bodies`` on the dead-letter queue; how to read its depth."""
    for body in bodies:
        await channel.default_exchange.publish(
            aio_pika.Message(body), routing_key=topology.dead_queue
        )

    async def depth() -> int:
        queue = await channel.declare_queue(topology.dead_queue, passive=True)
        return queue.declaration_result.message_count or 0

    return depth


async def test_replay_drop_stopped_by_sigterm_records_what_it_dropped_and_that_it_was_stopped(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    """Three dead letters: an undecodable one (dropped), then two whose lookup waits on a
    table the test locks, and SIGTERM comes then. The drop exits 1 saying it was
    interrupted; its record says 1 dropped, 2 read, ended, interrupted; the two letters it
    did not drop are back in the queue (before: killed, its record 0 and never ended)."""
    await broker.declare(settings)
    topology = amqp.Topology.from_settings(settings)
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        channel = await connection.channel()
        bodies = (b"not json at all", messages.encode(987654), messages.encode(987655))
        depth = await _dead_letters(channel, topology, *bodies)
        await rs.wait_for(lambda: _eq(depth, 3), 10, "three dead letters")
        locker = await asyncpg.connect(settings.database_url.get_secret_value())
        try:
            locked = locker.transaction()
            await locked.start()
            await locker.execute("LOCK TABLE deliveries IN ACCESS EXCLUSIVE MODE")
            env = rs.env_for(settings)
            args = ["replay", "--drop", "--apply", "--operator", "ana"]
            drop = await forked.spawn(args, env, stdout=forked.PIPE, stderr=forked.PIPE)

            await rs.wait_for(lambda: rs.waiting_on_a_lock(pool), 60, "the drop's lookup waiting")
            drop.send_signal(signal.SIGTERM)
            out, err = (b.decode() for b in await asyncio.wait_for(drop.communicate(), 60))
            await locked.rollback()
        finally:
            await locker.close()
        assert drop.returncode == 1, out + err[-2000:]
        assert "selected=2 dropped=1" in out and "interrupted by a signal" in out, out
        audit = await pool.fetchrow(
            "SELECT source, selected, dropped, interrupted, finished_at IS NOT NULL AS ended"
            " FROM replays"
        )
        assert tuple(audit) == ("drop", 2, 1, True, True)
        await rs.wait_for(lambda: _eq(depth, 2), 10, "the two letters not dropped back")


async def test_load_shows_progress_on_a_terminal_and_only_the_summary_otherwise(
    settings: Settings, partner: RunningPartner, tmp_path: object
) -> None:
    lines = "\n".join(rs.line(f"r{i}", partner.url()) for i in range(3000)) + "\n"
    plain = await rs.relay(settings, "reminders", "load", "-", stdin=lines)
    assert plain.code == 0 and plain.stdout.strip() == "loaded 3000 reminders"
    assert "load:" not in plain.stderr
    leader, follower = pty.openpty()
    proc = await asyncio.create_subprocess_exec(
        *forked.relay_command("reminders", "load", "-"),
        env=rs.env_for(settings),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=follower,
        cwd=rs.REPO,
    )
    os.close(follower)
    out, _ = await asyncio.wait_for(proc.communicate(lines.encode()), 60)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.returncode == 0
    assert out.decode().strip() == "loaded 3000 reminders"
    assert b"load: " in seen


async def test_reminders_runs_and_replay_print_one_json_document(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    await rs.load(
        pool,
        [
            rs.line("daily-7", partner.url(), daily_at="07:00", timezone="Europe/Berlin"),
            rs.line("now-1", partner.url()),
        ],
    )
    listed = await _json(settings, "reminders", "list")
    assert [r["id"] for r in listed["reminders"]] == ["daily-7", "now-1"]
    assert listed["reminders"][0]["schedule"] == "daily 07:00 Europe/Berlin"
    assert "destination" not in listed["reminders"][0]
    shown = await _json(settings, "reminders", "show", "daily-7", "--next", "3")
    assert len(shown["next_occurrences"]) == 3 and shown["missed_policy"] == "catch_up"
    assert "payload" not in shown and "destination" not in shown
    for _ in range(3):
        await rs.load(pool, [rs.line(f"again-{_}", partner.url())])
        await _ok(settings, "publish")
    first = await _json(settings, "runs", "list", "--limit", "2")
    assert [r["kind"] for r in first["runs"]] == ["publish", "publish"]
    rest = await _json(settings, "runs", "list", "--before", str(first["next_before"]))
    ids = [r["run_id"] for r in first["runs"] + rest["runs"]]
    assert ids == sorted(ids, reverse=True) and len(ids) == 3 and rest["next_before"] is None
    await pool.execute(
        "UPDATE deliveries SET state = 'dead', finished_at = now(), last_status = 400"
        " WHERE reminder_id = 'now-1'"
    )
    dry = await _json(settings, "replay", "--from", "ledger")
    assert (dry["source"], dry["apply"], dry["selected"], dry["replayed"]) == (
        "ledger",
        False,
        1,
        1,
    )
