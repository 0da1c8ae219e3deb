"""Provider budgets across replicas, throttle pauses, the urgent lane, slow destinations."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter

import asyncpg
import pytest

from service import outbox
from service.ops import partner as partner_mod
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


@pytest.mark.timeout(180)
async def test_three_replicas_share_one_budget_of_50_per_second(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    settings = settings.model_copy(update={"lease_seconds": 60.0})
    arrivals: list[float] = []
    partner.state.on_request = lambda name, key: arrivals.append(time.monotonic())
    await rs.load(pool, [rs.line(f"r{i}", partner.url()) for i in range(3000)])
    assert (await rs.relay(settings, "publish")).code == 0

    started = time.monotonic()
    consumers = [await rs.start_consumer(settings, BUDGETS="webhook=50/5") for _ in range(3)]
    try:
        await rs.wait_for(lambda: _delivered(pool, 3000), 150, "3,000 delivered", interval=0.5)
        elapsed = time.monotonic() - started
    finally:
        await _stop_all(consumers)

    first = arrivals[0]
    per_second = Counter(int(t - first) for t in arrivals)
    assert per_second[0] <= 50 + 5, per_second[0]
    over = {s: n for s, n in per_second.items() if n > 50 + 5}
    assert not over, f"seconds over budget+burst: {over}"
    steady = [per_second[s] for s in range(1, int(arrivals[-1] - first))]
    assert sum(steady) / len(steady) <= 50.5  # on average never above the budget
    assert elapsed <= 3000 / 50 * 1.10 + 3, elapsed  # close to the budget while backlogged
    assert partner.state.logical_events == 3000 and partner.state.duplicates == 0


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


def _has(items: list[float]) -> asyncio.Future[bool]:
    future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    future.set_result(bool(items))
    return future


async def _state_is(pool: asyncpg.Pool, state: str) -> bool:
    return set(await rs.states(pool)) == {state}
