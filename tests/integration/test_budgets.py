"""Provider budgets across replicas, throttle pauses, the urgent lane, slow destinations."""

from __future__ import annotations

import asyncio
import signal
import time
from datetime import datetime, timedelta

import asyncpg

from consumer import budget
from service import db, outbox
from service import partner as partner_mod
from service.settings import Settings
from tests.support import relay as rs
from tests.support.relay import RunningPartner


async def _delivered(pool: asyncpg.Pool, n: int) -> bool:
    return (await rs.states(pool)).get("delivered", 0) >= n


async def _stop_all(procs: list[asyncio.subprocess.Process]) -> None:
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
    by_path: dict[str, list[float]] = {"acme": [], "globex": []}
    partner.state.on_request = lambda name, key: by_path[name].append(time.monotonic())
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

    throttled_at = by_path["acme"][0]  # the first acme request got the 429
    # Requests already leased before the pause reached the other replica (<= one
    # lease window); after that, nothing for acme until Retry-After has passed.
    late = [t - throttled_at for t in by_path["acme"][1:] if 0.2 < t - throttled_at < 3.0]
    assert late == [], late
    globex_during_pause = [t for t in by_path["globex"] if throttled_at < t < throttled_at + 3]
    assert len(globex_during_pause) >= 60  # the other provider kept flowing (~40/s)
    assert partner.state.logical_events == 600


async def test_urgent_delivery_during_a_20000_bulk_drain_arrives_within_seconds(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    urgent_arrival: list[float] = []
    partner.state.on_request = lambda name, key: (
        urgent_arrival.append(time.monotonic()) if name == "urgent" else None
    )
    await rs.load(pool, [rs.line(f"b{i}", partner.url("bulk")) for i in range(20000)])
    assert (await rs.relay(settings, "publish", timeout=120)).code == 0
    consumer = await rs.start_consumer(settings, BUDGETS="webhook=2000/100")
    try:
        await rs.wait_for(lambda: _delivered(pool, 2000), 60, "bulk drain under way")
        async with pool.acquire() as conn, conn.transaction():
            await outbox.add_intent(
                conn, key="page-oncall-1", channel="webhook",
                destination=partner.url("urgent"), payload={"text": "now"}, urgent=True,
            )
        submitted = time.monotonic()
        assert (await rs.relay(settings, "publish")).code == 0
        await rs.wait_for(lambda: _has(urgent_arrival), 30, "urgent delivered")
        bulk_left = 20000 - (await rs.states(pool)).get("delivered", 0)
    finally:
        await _stop_all([consumer])
    assert urgent_arrival[0] - submitted < 5.0, urgent_arrival[0] - submitted
    assert bulk_left > 1000  # it really overtook a backlog


async def test_destination_that_never_answers_does_not_slow_the_healthy_ones(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    settings = settings.model_copy(update={"breaker_cooldown_seconds": 60.0})
    partner.state.rules["hang"] = partner_mod.PathRule(delay_seconds=3600)
    await rs.load(pool, [rs.line(f"a{i}", partner.url("healthy")) for i in range(2000)])
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings):
        started = time.monotonic()
        await rs.wait_for(lambda: _delivered(pool, 2000), 60, "baseline")
        alone = time.monotonic() - started

    # The hanging destination is on its own host:port, as a separate partner would be.
    hang = partner_mod.Partner()
    hang.rules["hang"] = partner_mod.PathRule(delay_seconds=3600)
    runner, port = await partner_mod.start(hang)
    try:
        lines = [rs.line(f"b{i}", partner.url("healthy")) for i in range(2000)]
        lines += [rs.line(f"h{i}", f"http://127.0.0.1:{port}/hooks/hang") for i in range(200)]
        await rs.load(pool, lines)
        assert (await rs.relay(settings, "publish")).code == 0
        async with rs.consumer_in_process(settings):
            started = time.monotonic()
            await rs.wait_for(lambda: _delivered(pool, 4000), 60, "healthy ones delivered")
            beside = time.monotonic() - started
    finally:
        await runner.cleanup()
    assert beside <= alone * 1.2 + 1.0, (alone, beside)
    # The circuit opened: far fewer requests reached the hanging host than were due.
    assert sum(hang.requests_by_path.values()) < 100


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
    await rs.load(pool, [rs.line("r1", partner.url("gone"), daily_at="06:00"),
                         rs.line("r2", partner.url("gone"))])
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


def _has(items: list[float]) -> asyncio.Future[bool]:
    future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    future.set_result(bool(items))
    return future


async def _state_is(pool: asyncpg.Pool, state: str) -> bool:
    return set(await rs.states(pool)) == {state}
