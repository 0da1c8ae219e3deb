"""The broker restarted, SIGKILLed or out of memory under a drain (issue 24, items 1-2).

One throwaway RabbitMQ node for the module (each test has its own namespace and
database); one ``relay consume`` process, an in-process partner that answers fast and
counts requests per idempotency key. The lease is 600 s, far beyond each test's waits,
so a row left ``sending`` would stay undelivered here instead of being taken over (and
its attempt recorded ``lost``) when its lease ran out.

Restart and SIGKILL (a drain of 5,000; the destination's share lets 25 of the 100
prefetched out at once, so at the break requests are on the wire and claims wait for a
slot):

- the requests on the wire when the session failed finished and were recorded
  (``accepted``); the claims waiting were released at once: with the node still down,
  no row is ``sending`` and each row's attempts equal the requests the partner got;
- between sessions ``/readyz`` answers 503 and ``/livez`` 200; the process reconnected
  without exiting, with one WARNING line for the outage and one INFO line for its end;
- at the end: every row delivered, no ``lost`` attempt, no dead letter, attempts equal
  to requests per key, and a key sent twice only where an attempt was recorded lost or
  possibly delivered (here: none).

Alarm: ``set_vm_memory_high_watermark 0.0001`` for 60 s under a drain in which one key
in ten is answered 503 once (its retry is published, which gets the connection blocked):
the consumer pauses instead of cycling sessions, the broker redelivers nothing, and every
delivery reaches the receiver exactly once. A publish run, and a ``relay backfill
--publish``, stopped by SIGTERM while the alarm holds back their confirms record how they
ended, exit 1, and leave what they did not publish pending for the next run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from pydantic import SecretStr

from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import broker, forked
from tests.support import relay as rs
from tests.support.fleet import dead_letters, eventually, get_json
from tests.support.nodes import RabbitNode, free_port
from tests.support.relay import RunningPartner

pytestmark = [pytest.mark.fault, pytest.mark.timeout(420)]

DRAIN_ROWS = 5000
DRAIN_DELAY_SECONDS = 0.2  # each drain request: 25 on the wire drain ~125/s
ALARM_ROWS = 1000
ALARM_LATE_ROWS = 100  # loaded and published while the alarm is on
# The alarm test's heartbeat and confirm timeout, shorter than the defaults (8 s: a 27 s
# window; 15 s) so that holding the alarm past both takes 30 s, not a minute.
ALARM_HEARTBEAT_SECONDS = 5  # a window of 3 x (5 + 1) = 18 s
ALARM_CONFIRM_TIMEOUT_SECONDS = 5.0
ALARM_SECONDS = 30.0
LEASE_SECONDS = 600.0
# Requests on the wire at once: destination_max_share of the prefetch (100). A quarter, so
# that when the requests on the wire end and as many waiting claims take their slots, 50
# still wait: with half (as before), the waiting claims were all on the wire until the
# broker's next messages were claimed, and a break landing then (seen once, two suites on
# a slow VM) found none to release.
SLOTS = 25


def _settings(settings: Settings, rabbit: RabbitNode) -> Settings:
    return settings.model_copy(
        update={
            "amqp_url": SecretStr(rabbit.url),
            "lease_seconds": LEASE_SECONDS,
            "http_timeout_seconds": 5.0,
            "shutdown_grace_seconds": 10.0,
            "prefetch": 100,
            "destination_max_share": SLOTS / 100,  # 25 requests on the wire at once, 75 wait
            "destination_wait_seconds": 60.0,  # for a slot (not deferred meanwhile)
            "rescue_after_seconds": 3600.0,
        }
    )


def _log(path: Path, event: str) -> list[dict[str, Any]]:
    """The consumer's JSON log lines with this ``event``."""
    return rs.log_events(path.read_text(), event) if path.exists() else []


def _logged(path: Path, event: str) -> Callable[[], Any]:
    async def seen() -> bool:
        return bool(_log(path, event))

    return seen


async def _prepare(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, rows: int, path: str
) -> None:
    lines = [
        rs.line(f"r{i}", partner.url("flaky" if path == "flaky" and i % 10 == 0 else "drain"))
        for i in range(rows)
    ]
    assert await rs.load(pool, lines) == rows
    published = await rs.relay(settings, "publish", timeout=120)
    assert published.code == 0, published.stdout + published.stderr[-2000:]


async def _count(pool: asyncpg.Pool, state: str) -> int:
    return (await rs.states(pool)).get(state, 0)


async def _attempts_differ_from_requests(
    pool: asyncpg.Pool, partner: RunningPartner
) -> list[tuple[int, int, int]]:
    """(id, attempts, requests the partner got with its key) where they differ."""
    rows = await pool.fetch("SELECT id, idempotency_key, attempts FROM deliveries")
    seen = partner.state.events  # the partner answers 200 to every request here
    return [
        (r["id"], r["attempts"], seen.get(r["idempotency_key"], 0))
        for r in rows
        if r["attempts"] != seen.get(r["idempotency_key"], 0)
    ]


async def _outcomes(pool: asyncpg.Pool) -> dict[str, int]:
    rows = await pool.fetch("SELECT outcome, count(*) AS n FROM delivery_attempts GROUP BY 1")
    return {r["outcome"]: r["n"] for r in rows}


async def _resent_without_cause(pool: asyncpg.Pool, partner: RunningPartner) -> list[str]:
    """Keys the partner got more than once although no attempt of theirs was recorded
    lost or possibly delivered (the only attempts a resend with the same key may follow)."""
    excused = {
        r["idempotency_key"]
        for r in await pool.fetch(
            "SELECT DISTINCT d.idempotency_key FROM delivery_attempts a"
            " JOIN deliveries d ON d.id = a.delivery_id"
            " WHERE a.outcome = 'lost' OR a.possibly_delivered"
        )
    }
    return [k for k, n in partner.state.events.items() if n > 1 and k not in excused]


async def _on_the_wire_at(pool: asyncpg.Pool, moment: datetime) -> dict[str, int]:
    """Outcomes of the attempts whose request was out at ``moment``."""
    rows = await pool.fetch(
        "SELECT outcome, count(*) AS n FROM delivery_attempts"
        " WHERE started_at <= $1"
        " AND started_at + latency_ms * interval '1 millisecond' > $1 GROUP BY 1",
        moment,
    )
    return {r["outcome"]: r["n"] for r in rows}


async def _drain_through_a_broker_break(
    settings: Settings,
    pool: asyncpg.Pool,
    partner: RunningPartner,
    rabbit: RabbitNode,
    log_path: Path,
    break_broker: Callable[[], None],
    bring_back: Callable[[], None],
) -> None:
    settings = _settings(settings, rabbit)
    partner.state.rules["drain"] = partner_mod.PathRule(delay_seconds=DRAIN_DELAY_SECONDS)
    await _prepare(settings, pool, partner, DRAIN_ROWS, "drain")
    health_port = free_port()
    consumer = await rs.start_consumer(settings, log_path, HEALTH_PORT=str(health_port))
    try:

        async def under_way() -> bool:
            return await _count(pool, "delivered") >= 1000

        assert await eventually(under_way, 120), "the drain never got under way"
        # Requests slower than the claims: every slot's request on the wire for 3 s (below
        # the 5 s HTTP timeout, within the shutdown grace), so the claimed rest of the
        # prefetch waits for a slot at the break, however loaded the machine. At 0.2 s a
        # claimer slowed by load had no claim waiting when the connection closed.
        partner.state.rules["drain"] = partner_mod.PathRule(delay_seconds=3.0)

        async def claims_waiting_for_a_slot() -> bool:
            return await _count(pool, "sending") > SLOTS

        assert await eventually(claims_waiting_for_a_slot, 60), await rs.states(pool)
        await asyncio.to_thread(break_broker)
        assert await eventually(_logged(log_path, "consume_stopping"), 60), "session never ended"
        # The node is still down: what the session held was settled or released at once.
        assert await _count(pool, "sending") == 0, await rs.states(pool)
        assert await _attempts_differ_from_requests(pool, partner) == []
        (lost,) = _log(log_path, "broker_reconnect")
        assert lost["level"] == "WARNING"
        on_the_wire = await _on_the_wire_at(pool, datetime.fromisoformat(lost["time"]))
        assert on_the_wire.get("accepted", 0) > 0, on_the_wire  # the point was exercised
        assert set(on_the_wire) == {"accepted"}, on_the_wire
        assert _log(log_path, "given_back"), "no claim waiting for a slot at the break"
        # Between sessions: not ready, but alive (a liveness restart would end the wait).
        assert (await get_json(health_port, "/readyz"))[0] == 503
        assert (await get_json(health_port, "/livez"))[0] == 200
        delivered_at_break = await _count(pool, "delivered")
        assert delivered_at_break < DRAIN_ROWS

        partner.state.rules["drain"] = partner_mod.PathRule(delay_seconds=DRAIN_DELAY_SECONDS)
        await asyncio.to_thread(bring_back)

        async def all_delivered() -> bool:
            return await _count(pool, "delivered") == DRAIN_ROWS

        assert await eventually(all_delivered, 240), await rs.states(pool)
        assert consumer.returncode is None, "the consumer exited instead of reconnecting"
    finally:
        code = await rs.stop(consumer)
    assert code == 0
    assert await rs.states(pool) == {"delivered": DRAIN_ROWS}
    assert await _outcomes(pool) == {"accepted": DRAIN_ROWS}  # no lost, no failed attempt
    assert await _attempts_differ_from_requests(pool, partner) == []
    assert await _resent_without_cause(pool, partner) == []
    assert partner.state.logical_events == DRAIN_ROWS
    assert await dead_letters(settings.amqp_url.get_secret_value(), settings.amqp_namespace) == []
    (back,) = _log(log_path, "broker_reconnected")
    assert back["level"] == "INFO" and back["attempts"] >= 1, back
    assert len(_log(log_path, "broker_reconnect")) == 1
    assert len(_log(log_path, "consume_started")) == 2  # the first session and one more


async def test_broker_restarted_mid_drain_finishes_sends_releases_waits_and_loses_nothing(
    settings: Settings,
    pool: asyncpg.Pool,
    partner: RunningPartner,
    module_rabbit: RabbitNode,
    tmp_path: Path,
) -> None:
    await _drain_through_a_broker_break(
        settings,
        pool,
        partner,
        module_rabbit,
        tmp_path / "consumer.log",
        module_rabbit.stop,  # rabbitmqctl stop: the node closes every connection
        module_rabbit.start,
    )


async def test_broker_sigkilled_mid_drain_finishes_sends_releases_waits_and_loses_nothing(
    settings: Settings,
    pool: asyncpg.Pool,
    partner: RunningPartner,
    module_rabbit: RabbitNode,
    tmp_path: Path,
) -> None:
    await _drain_through_a_broker_break(
        settings,
        pool,
        partner,
        module_rabbit,
        tmp_path / "consumer.log",
        module_rabbit.kill,
        module_rabbit.restart,  # cleans up after the kill, then starts on the same data
    )


async def test_a_memory_alarm_pauses_the_consumer_without_cycling_sessions_or_redeliveries(
    settings: Settings,
    pool: asyncpg.Pool,
    partner: RunningPartner,
    module_rabbit: RabbitNode,
    tmp_path: Path,
) -> None:
    settings = _settings(settings, module_rabbit).model_copy(
        update={
            "http_timeout_seconds": 15.0,  # a 4 s answer (below) never times out, however loaded
            "amqp_heartbeat_seconds": ALARM_HEARTBEAT_SECONDS,
            "publish_confirm_timeout_seconds": ALARM_CONFIRM_TIMEOUT_SECONDS,
        }
    )
    # 50 requests at a time, 1 s each: ~20 s of drain, so most of it (and most first
    # requests of the flaky keys) is still ahead when the alarm is on, however long
    # rabbitmqctl takes on a loaded machine (at 0.5 s a drain finished under it first).
    partner.state.rules["drain"] = partner_mod.PathRule(delay_seconds=1.0)
    # One key in ten: 503 on its first request, so its retry is published (a publishing
    # connection is what the broker blocks), then 200.
    partner.state.rules["flaky"] = partner_mod.PathRule(
        status=503, first_n_per_key=1, delay_seconds=1.0
    )
    await _prepare(settings, pool, partner, ALARM_ROWS, "flaky")
    log_path = tmp_path / "consumer.log"
    redelivered_before = await asyncio.to_thread(
        module_rabbit.quorum_counter, "messages_redelivered_total"
    )
    consumer = await rs.start_consumer(settings, log_path)
    alarm_on = False
    publishing: asyncio.Task[rs.Result] | None = None
    try:

        async def under_way() -> bool:
            return await _count(pool, "delivered") >= ALARM_ROWS // 20

        assert await eventually(under_way, 120), "the drain never got under way"
        # Slow the rest of the drain (~75 s now) while rabbitmqctl raises the alarm: under
        # two suites it took longer than the 20 s drain, which then published nothing more
        # for the broker to block (a block needs a publish: a flaky key's retry).
        partner.state.rules["drain"] = partner_mod.PathRule(delay_seconds=4.0)
        partner.state.rules["flaky"] = partner_mod.PathRule(
            status=503, first_n_per_key=1, delay_seconds=4.0
        )
        await asyncio.to_thread(module_rabbit.ctl, "set_vm_memory_high_watermark", "0.0001")
        alarm_on = True
        assert await eventually(_logged(log_path, "broker_blocked"), 30), (
            "the consumer's connection was never blocked"
        )
        # A publish run started now is blocked at its first publish, for longer than its
        # confirm timeout: it waits the alarm out instead of failing the run.
        late = [rs.line(f"late{i}", partner.url("drain")) for i in range(ALARM_LATE_ROWS)]
        assert await rs.load(pool, late) == ALARM_LATE_ROWS
        publishing = asyncio.create_task(rs.relay(settings, "publish", timeout=180))

        async def session_cycled() -> bool:
            return consumer.returncode is not None or bool(_log(log_path, "consume_stopping"))

        # Held for its whole length (past the confirm timeout and the heartbeat window),
        # watching that the session neither ends nor the process exits meanwhile.
        assert not await eventually(session_cycled, ALARM_SECONDS), "the session ended"
        assert await _count(pool, "delivered") < ALARM_ROWS, "drained before the alarm ended"
        await asyncio.to_thread(module_rabbit.ctl, "set_vm_memory_high_watermark", "0.4")
        alarm_on = False
        assert await eventually(_logged(log_path, "broker_unblocked"), 30), "never unblocked"
        published = await publishing
        assert published.code == 0, published.stdout + published.stderr[-2000:]
        events = [json.loads(x).get("event") for x in published.stderr.splitlines() if x[:1] == "{"]
        assert "broker_blocked" in events and "broker_unblocked" in events, events
        assert f"published={ALARM_LATE_ROWS}" in published.stdout, published.stdout
        # Nothing more to watch: the rest of the drain at full speed.
        partner.state.rules["drain"] = partner_mod.PathRule()
        partner.state.rules["flaky"] = partner_mod.PathRule(status=503, first_n_per_key=1)

        async def all_delivered() -> bool:
            return await _count(pool, "delivered") == ALARM_ROWS + ALARM_LATE_ROWS

        assert await eventually(all_delivered, 120), await rs.states(pool)
        assert consumer.returncode is None, "the consumer exited during the alarm"
    finally:
        if alarm_on:
            await asyncio.to_thread(module_rabbit.ctl, "set_vm_memory_high_watermark", "0.4")
        if publishing is not None:  # not left running: it ends once the alarm is off
            with contextlib.suppress(Exception):
                await asyncio.wait_for(publishing, 60)
        code = await rs.stop(consumer)
    assert code == 0
    await _alarm_cost_nothing(settings, pool, partner, module_rabbit, log_path, redelivered_before)


async def test_publishes_the_broker_refuses_end_the_run_incomplete_counting_each_row_once(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, module_rabbit: RabbitNode
) -> None:
    """A broker that nacks publishes to the bulk lane (a full queue with
    ``reject-publish``: a policy of length 0, past which a quorum queue refuses all but
    the first): the run ends incomplete, and the rows it reports left pending are the rows
    the ledger holds pending, each counted once although the pending sweep tried it again."""
    settings = _settings(settings, module_rabbit)
    rows = 10
    lines = [rs.line(f"n{i}", partner.url("drain")) for i in range(rows)]
    assert await rs.load(pool, lines) == rows
    policy = f"refuse-{settings.amqp_namespace}"
    pattern = f"^{re.escape(settings.amqp_namespace)}\\.deliveries$"
    refuse = json.dumps({"max-length": 0, "overflow": "reject-publish"})
    await asyncio.to_thread(
        module_rabbit.ctl, "set_policy", "--apply-to", "queues", policy, pattern, refuse
    )
    try:
        # Past its length already: a quorum queue refuses only what comes once it knows
        # it is full, and the run's publishes go out together.
        await broker.declare(settings)
        await broker.publish_raw(settings, [b"filler"])
        refused = await rs.relay(settings, "publish")
    finally:
        await asyncio.to_thread(module_rabbit.ctl, "clear_policy", policy)
    assert refused.code == 1, refused.stdout + refused.stderr[-2000:]
    states = await rs.states(pool)
    pending = states.get("pending", 0)
    assert pending >= rows - 1 and pending + states.get("queued", 0) == rows, states
    assert f"rescued=0 left_pending={pending} " in refused.stdout, (refused.stdout, states)
    run = await pool.fetchrow("SELECT status, failed_count FROM publish_runs")
    assert (run["status"], run["failed_count"]) == ("incomplete", pending)

    await _next_run_publishes(settings, pool, pending, rows)


async def test_a_publish_run_stopped_while_an_alarm_blocks_it_records_interrupted(
    settings: Settings,
    pool: asyncpg.Pool,
    partner: RunningPartner,
    module_rabbit: RabbitNode,
    tmp_path: Path,
) -> None:
    """A Job's deadline reached during a long alarm (SIGTERM): the run, waiting on confirms
    the broker holds back, records itself ``interrupted`` instead of staying ``running``,
    exits 1, and what it did not publish is published by the next run once the alarm ends."""
    settings = _settings(settings, module_rabbit)
    rows = 20
    assert await rs.load(pool, [rs.line(f"a{i}", partner.url("drain")) for i in range(rows)])
    log_path = tmp_path / "publish.log"
    code, out = await _stopped_while_blocked(settings, module_rabbit, ["publish"], log_path)
    assert code == 1, out + log_path.read_text()[-2000:]
    assert " interrupted: " in out, out
    assert _log(log_path, "publish_run_stopped")
    status, finished = await pool.fetchrow("SELECT status, finished_at FROM publish_runs")
    assert status == "interrupted" and finished is not None

    await _next_run_publishes(settings, pool, rows, rows)


async def test_a_backfill_stopped_while_an_alarm_blocks_its_publishes_leaves_its_rows_pending(
    settings: Settings,
    pool: asyncpg.Pool,
    partner: RunningPartner,
    module_rabbit: RabbitNode,
    tmp_path: Path,
) -> None:
    """``relay backfill --apply --publish`` stopped (SIGTERM) while the broker holds back
    its confirms: none of its rows is marked queued, its run says ``incomplete``, the
    summary says it was interrupted (exit 1), and the next publish run sends them all."""
    settings = _settings(settings, module_rabbit)
    await rs.load(pool, [rs.line("every-minute", partner.url("drain"), cron="* * * * *")])
    since = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    args = ["backfill", "--reminder", "every-minute", "--from", since, "--apply", "--publish"]
    log_path = tmp_path / "backfill.log"
    code, out = await _stopped_while_blocked(settings, module_rabbit, args, log_path)
    assert code == 1, out + log_path.read_text()[-2000:]
    assert "interrupted by a signal" in out, out
    run_id, status = await pool.fetchrow("SELECT id, status FROM publish_runs")
    assert status == "incomplete"
    admitted = await rs.states(pool)
    assert set(admitted) == {"pending"} and admitted["pending"] >= 5, admitted

    after = await rs.relay(settings, "publish")
    assert after.code == 0, after.stdout + after.stderr[-2000:]
    queued = await pool.fetchval(
        "SELECT count(*) FROM deliveries WHERE run_id = $1 AND state = 'queued'", run_id
    )
    assert queued == admitted["pending"]


async def _stopped_while_blocked(
    settings: Settings, rabbit: RabbitNode, args: list[str], log_path: Path
) -> tuple[int | None, str]:
    """Run ``relay ARGS`` during a memory alarm (its log to ``log_path``); once its
    connection is blocked, SIGTERM it. Its exit code and stdout; the alarm is cleared."""
    await asyncio.to_thread(rabbit.ctl, "set_vm_memory_high_watermark", "0.0001")
    try:
        with open(log_path, "ab") as log:
            run = await forked.spawn(args, rs.env_for(settings), stdout=forked.PIPE, stderr=log)
        await rs.wait_for(_logged(log_path, "broker_blocked"), 60, f"relay {args[0]} blocked")
        run.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(run.communicate(), 60)
    finally:
        await asyncio.to_thread(rabbit.ctl, "set_vm_memory_high_watermark", "0.4")
    return run.returncode, out.decode()


async def _next_run_publishes(settings: Settings, pool: asyncpg.Pool, left: int, rows: int) -> None:
    """The next publish run ends ok, publishing the ``left`` rows; all ``rows`` queued."""
    after = await rs.relay(settings, "publish")
    assert after.code == 0, after.stdout + after.stderr[-2000:]
    assert f"published={left} " in after.stdout, after.stdout
    assert await rs.states(pool) == {"queued": rows}


async def _alarm_cost_nothing(
    settings: Settings,
    pool: asyncpg.Pool,
    partner: RunningPartner,
    rabbit: RabbitNode,
    log_path: Path,
    redelivered_before: int,
) -> None:
    assert len(_log(log_path, "consume_started")) == 1  # one session throughout
    assert _log(log_path, "broker_reconnect") == []
    assert _log(log_path, "publish_failed") == []
    redelivered = await asyncio.to_thread(rabbit.quorum_counter, "messages_redelivered_total")
    assert redelivered == redelivered_before  # nothing moved toward x-delivery-limit
    total = ALARM_ROWS + ALARM_LATE_ROWS
    assert await rs.states(pool) == {"delivered": total}
    outcomes = await _outcomes(pool)
    assert outcomes.get("lost", 0) == 0, outcomes
    assert outcomes == {"accepted": total, "retry": ALARM_ROWS // 10}, outcomes
    assert all(n == 1 for n in partner.state.events.values())  # exactly once per key
    assert partner.state.logical_events == total
    assert await dead_letters(settings.amqp_url.get_secret_value(), settings.amqp_namespace) == []
