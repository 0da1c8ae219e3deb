"""Provider budgets across replicas, throttle pauses, the urgent lane, slow destinations."""

from __future__ import annotations

import asyncio
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
from aiohttp import web

from consumer import budget
from service import db, outbox
from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import forked
from tests.support import relay as rs
from tests.support.relay import RunningPartner


async def _delivered(pool: asyncpg.Pool, n: int) -> bool:
    return (await rs.states(pool)).get("delivered", 0) >= n


async def _stop_all(procs: list[forked.RelayProcess]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    codes = [await asyncio.wait_for(p.wait(), 30) for p in procs]
    assert codes == [0] * len(procs)


def _max_in_any_window(times: list[datetime], seconds: float) -> tuple[int, datetime | None]:
    """The most of ``times`` in any closed interval of ``seconds`` (any start), and where
    that interval starts. Every such interval can slide to start at one of the times."""
    ordered = sorted(times)
    best, best_start, first = 0, None, 0
    width = timedelta(seconds=seconds)
    for last, end in enumerate(ordered):
        while ordered[first] < end - width:
            first += 1
        if last - first + 1 > best:
            best, best_start = last - first + 1, ordered[first]
    return best, best_start


async def _send_instants(pool: asyncpg.Pool, reminder_prefix: str = "") -> list[datetime]:
    """started_at of every attempt that made a request (the time taken just before it),
    for the reminders whose id starts with ``reminder_prefix``."""
    rows = await pool.fetch(
        "SELECT a.started_at FROM delivery_attempts a JOIN deliveries d ON d.id = a.delivery_id"
        " WHERE a.outcome <> 'skipped' AND starts_with(d.reminder_id, $1)",
        reminder_prefix,
    )
    return [r["started_at"] for r in rows]


async def test_three_replicas_keep_every_one_second_window_within_rate_plus_burst(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    # Budget 50/s, burst 5: at most 55 requests in any 1 s, across the replicas, counted
    # on the time each replica took just before each request. The hardest case: every
    # replica holds a backlog when a full bucket opens. The budget starts paused (as a
    # throttle answer would leave it) until all 450 are claimed and waiting for it.
    settings = settings.model_copy(update={"lease_seconds": 60.0})
    await pool.execute(db.q("configure_budget"), "webhook", 50.0, 5.0)
    await pool.execute(db.q("pause_budget"), "webhook", 25.0)
    await rs.load(pool, [rs.line(f"a{i}", partner.url()) for i in range(450)])
    assert (await rs.relay(settings, "publish")).code == 0
    consumers = [await rs.start_consumer(settings, BUDGETS="webhook=50/5") for _ in range(3)]
    try:
        await rs.wait_for(lambda: _all_claimed(pool, 450), 20, "all 450 waiting for budget")
        await pool.execute("UPDATE rate_budgets SET paused_until = now()")
        await rs.wait_for(lambda: _delivered(pool, 450), 60, "all delivered", interval=0.5)
    finally:
        await _stop_all(consumers)

    sent = await _send_instants(pool)
    assert len(sent) == 450  # one request per delivery: waiting cost no attempt
    most, where = _max_in_any_window(sent, 1.0)
    assert most <= 50 + 5, f"{most} requests in the second from {where}"
    assert partner.state.logical_events == 450 and partner.state.duplicates == 0


async def test_lease_grants_stamped_by_the_database_never_exceed_the_bucket(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    # The bucket itself, on the times the database stamps on each grant: six connections
    # lease at once as fast as they can, so the row lock decides the order.
    spec = budget.BudgetSpec(50, 5)
    plan = budget.plan_bucket(spec)
    await pool.execute(db.q("configure_budget"), "p", spec.rate_per_second, spec.burst)
    grants: list[tuple[datetime, int]] = []

    async def lease_for(seconds: float) -> None:
        async with asyncpg.create_pool(
            settings.database_url.get_secret_value(), min_size=1, max_size=1
        ) as own:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                row = await own.fetchrow(db.q("lease_tokens"), "p", 2, 0.0, plan.capacity)
                assert row is not None
                if row["granted"]:
                    grants.append((row["granted_at"], row["granted"]))

    await asyncio.gather(*(lease_for(2.0) for _ in range(6)))
    assert grants
    times = sorted(t for t, n in grants for _ in range(n))
    for seconds in (0.0, 0.02, 0.1, 0.5, 1.0):
        most, where = _max_in_any_window(times, seconds)
        bound = budget.max_grants(plan.capacity, spec.rate_per_second, seconds)
        assert most <= bound, f"{most} grants in {seconds} s from {where}, bound {bound}"


async def test_429_retry_after_pauses_that_provider_for_every_replica_only(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    settings = settings.model_copy(update={"lease_seconds": 30.0})
    partner.state.rules["acme"] = partner_mod.PathRule(status=429, retry_after="3", first_n=1)
    lines = [rs.line(f"a{i}", partner.url("acme"), provider="acme") for i in range(300)]
    lines += [rs.line(f"g{i}", partner.url("globex"), provider="globex") for i in range(300)]
    await rs.load(pool, lines)
    assert (await rs.relay(settings, "publish")).code == 0
    budgets = "acme=40/2,globex=40/2"
    consumers = [await rs.start_consumer(settings, BUDGETS=budgets) for _ in range(2)]
    try:
        await rs.wait_for(lambda: _delivered(pool, 600), 60, "all delivered", interval=0.5)
    finally:
        await _stop_all(consumers)

    # The pause as the database recorded it: it began 3 s before paused_until.
    paused_until = await pool.fetchval(
        "SELECT paused_until FROM rate_budgets WHERE provider = 'acme'"
    )
    assert paused_until is not None, "the throttle did not pause the shared budget"
    pause_began = paused_until - timedelta(seconds=3)
    # Tokens leased before the pause are spent within the budget's spend deadline; the
    # rest of the margin is for a process descheduled between its token and its request.
    obeyed = pause_began + timedelta(
        seconds=budget.plan_bucket(budget.BudgetSpec(40, 2)).spend_deadline_seconds + 0.5
    )
    acme = await _send_instants(pool, "a")
    assert len(acme) == 301  # 300 accepted and the one throttled
    late = [t for t in acme if obeyed < t < paused_until]
    assert late == [], f"acme requests during its pause: {late}"
    globex = await _send_instants(pool, "g")
    assert any(obeyed < t < paused_until for t in globex)  # the other provider kept flowing
    assert partner.state.logical_events == 600


@pytest.mark.timeout(420)  # 20,000 deliveries on a busy 2-core machine (two suites: 220 s)
async def test_urgent_delivery_during_a_20000_bulk_drain_overtakes_the_backlog(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    await rs.load(pool, [rs.line(f"b{i}", partner.url("bulk")) for i in range(20000)])
    assert (await rs.relay(settings, "publish", timeout=120)).code == 0
    log = tmp_path / "consumer.log"
    consumer = await rs.start_consumer(settings, log, BUDGETS="webhook=2000/100")
    try:
        try:
            await rs.wait_for(lambda: _delivered(pool, 2000), 240, "bulk drain under way")
        except AssertionError as exc:  # what the ledger and the consumer say, to diagnose
            tail = log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"{exc}: {await rs.states(pool)}\n{tail}") from exc
        async with pool.acquire() as conn, conn.transaction():
            await outbox.add_intent(
                conn,
                key="page-oncall-1",
                channel="webhook",
                destination=partner.url("urgent"),
                payload={"text": "now"},
                urgent=True,
                allow_networks=rs.LOOPBACK,
            )
        assert (await rs.relay(settings, "publish")).code == 0
        await rs.wait_for(lambda: _urgent_delivered(pool), 60, "urgent delivered")
    finally:
        await _stop_all([consumer])
    urgent = await pool.fetchrow(
        "SELECT d.created_at, d.published_at, d.attempts, a.started_at FROM deliveries d"
        " JOIN delivery_attempts a ON a.delivery_id = d.id WHERE d.urgent"
    )
    assert urgent["attempts"] == 1
    # Bulk requests sent between the urgent message reaching the broker and its request:
    # those already past the budget or holding a token when it arrived, not the queue
    # ahead of it (18,000 deep). Counted, not timed: a slow machine is slower on both sides.
    ahead = await pool.fetchval(
        "SELECT count(*) FROM deliveries d JOIN delivery_attempts a ON a.delivery_id = d.id"
        " WHERE NOT d.urgent AND a.started_at BETWEEN $1 AND $2",
        urgent["published_at"],
        urgent["started_at"],
    )
    # Bulk rows queued before it and not yet sent when it was: the backlog it overtook.
    overtaken = await pool.fetchval(
        "SELECT count(*) FROM deliveries d WHERE NOT d.urgent AND d.created_at < $1"
        " AND NOT EXISTS (SELECT FROM delivery_attempts a"
        "                 WHERE a.delivery_id = d.id AND a.started_at <= $2)",
        urgent["created_at"],
        urgent["started_at"],
    )
    assert overtaken >= 1000, overtaken  # it really overtook a backlog
    assert ahead <= 1000, ahead


async def test_destination_that_never_answers_does_not_hold_up_the_healthy_ones(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    settings = settings.model_copy(update={"breaker_cooldown_seconds": 60.0})
    # The hanging destination is on its own host:port, as a separate partner would be; it
    # records when each request came.
    held: list[datetime] = []

    async def hang(request: web.Request) -> web.Response:
        held.append(datetime.now(UTC))
        await asyncio.Event().wait()
        raise AssertionError("never answers")

    app = web.Application()
    app.router.add_post("/hooks/hang", hang)
    runner, port = await partner_mod.serve(app)
    try:
        # One hanging delivery after every ten healthy ones, so they meet in the prefetch.
        lines = []
        for i in range(2000):
            lines.append(rs.line(f"a{i}", partner.url("healthy")))
            if i % 10 == 9:
                lines.append(rs.line(f"h{i}", f"http://127.0.0.1:{port}/hooks/hang"))
        await rs.load(pool, lines)
        assert (await rs.relay(settings, "publish")).code == 0
        async with rs.consumer_in_process(settings):
            await rs.wait_for(lambda: _delivered(pool, 2000), 60, "healthy ones delivered")
    finally:
        await runner.cleanup()
    # Healthy requests went out while the hanging destination held requests (each is
    # held until the client's timeout), and each healthy delivery took one attempt.
    assert held, "no request reached the hanging destination"
    timeout = timedelta(seconds=settings.http_timeout_seconds)
    healthy = await _send_instants(pool, "a")
    assert len(healthy) == 2000
    beside = [t for t in healthy if any(h <= t <= h + timeout for h in held)]
    assert beside, "no healthy request while the hanging destination held one"
    # Its circuit opened: far fewer requests reached it than the 200 due, and its
    # deliveries waited without using attempts.
    assert len(held) < 100, len(held)
    attempts = await pool.fetchval(
        "SELECT sum(attempts) FROM deliveries WHERE starts_with(reminder_id, 'h')"
    )
    assert attempts == len(held)


async def test_destination_resolving_to_a_private_address_at_send_time_is_dead_with_reason(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    # Allowed when loaded; by send time the policy (like a DNS answer) says loopback.
    await rs.load(pool, [rs.line("r1", f"http://localhost:{partner.port}/hooks/x")])
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings.model_copy(update={"allow_networks": ""})):
        await rs.wait_for(lambda: _state_is(pool, "dead"), 20, "dead")
    row = await pool.fetchrow("SELECT * FROM deliveries")
    assert row["last_error"] == "rejected: ssrf: loopback address"
    assert sum(partner.state.requests_by_path.values()) == 0


async def test_410_gone_disables_the_destination_and_dead_letters(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    partner.state.rules["gone"] = partner_mod.PathRule(status=410)
    await rs.load(
        pool,
        [rs.line("r1", partner.url("gone"), daily_at="06:00"), rs.line("r2", partner.url("gone"))],
    )
    await pool.execute("UPDATE reminders SET next_due_at = now() - interval '1 second'")
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings):
        await rs.wait_for(lambda: _state_is(pool, "dead"), 20, "dead")
    rows = await pool.fetch("SELECT last_error FROM deliveries ORDER BY id")
    errors = sorted(r["last_error"] for r in rows)
    assert errors[0].startswith("rejected: 410 gone") or errors[1].startswith("rejected: 410")
    assert partner.state.requests_by_path["gone"] >= 1
    assert await pool.fetchval("SELECT count(*) FROM reminders WHERE active") == 0
    listed = await rs.relay(settings, "destinations", "list")
    assert partner.url("gone") in listed.stdout


async def _all_claimed(pool: asyncpg.Pool, n: int) -> bool:
    return (await rs.states(pool)).get("sending", 0) == n


async def _urgent_delivered(pool: asyncpg.Pool) -> bool:
    return bool(await pool.fetchval("SELECT state = 'delivered' FROM deliveries WHERE urgent"))


async def _state_is(pool: asyncpg.Pool, state: str) -> bool:
    return set(await rs.states(pool)) == {state}
