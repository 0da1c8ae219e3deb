"""The expiring-holds example (examples/holds) against real PostgreSQL, RabbitMQ and HTTP:
concurrent expiry workers, a confirmation racing an expiry, a worker killed before its
commit, and a committed expiry's email delivered through a Resend-style API."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from pydantic import SecretStr

from examples.holds import worker as holds
from service import db
from service.settings import Settings
from tests.support import relay as rs
from tests.support.email_api import API_KEY, SENDER, FakeEmailApi, serve_email_api

pytestmark = pytest.mark.timeout(60)


async def _one(pool: asyncpg.Pool, sql: str, *args: object) -> asyncpg.Record:
    row = await pool.fetchrow(sql, *args)
    assert row is not None, sql
    return row


@pytest.fixture
async def email_api() -> AsyncIterator[FakeEmailApi]:
    async with serve_email_api() as api:
        yield api


@pytest.fixture
async def holds_pool(pool: asyncpg.Pool) -> asyncpg.Pool:
    """The test database's pool with the example's table applied."""
    await holds.apply_schema(pool)
    return pool


async def _due_holds(pool: asyncpg.Pool, n: int, now: datetime) -> list[int]:
    return [
        await holds.create_hold(pool, f"customer{i}@example.com", now - timedelta(seconds=i + 1))
        for i in range(n)
    ]


async def _states(pool: asyncpg.Pool) -> dict[int, str]:
    return {r["id"]: r["state"] for r in await pool.fetch("SELECT id, state FROM holds")}


async def _intents(pool: asyncpg.Pool) -> dict[str, asyncpg.Record]:
    rows = await pool.fetch("SELECT * FROM deliveries WHERE source = 'outbox'")
    return {r["idempotency_key"]: r for r in rows}


def _key(hold_id: int) -> str:
    return f"outbox:{holds.intent_key(hold_id)}"


async def _run_worker(settings: Settings, *args: str, **env: str) -> rs.Result:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "examples.holds.worker",
        *args,
        env={**rs.env_for(settings), **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=rs.REPO,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return rs.Result(proc.returncode, out.decode(), err.decode())


async def test_two_workers_at_once_expire_101_due_holds_each_once_with_one_intent(
    settings: Settings, holds_pool: asyncpg.Pool
) -> None:
    now = datetime.now(UTC)
    due = await _due_holds(holds_pool, 101, now)
    later = await holds.create_hold(holds_pool, "later@example.com", now + timedelta(hours=1))
    confirmed = await holds.create_hold(holds_pool, "done@example.com", now - timedelta(hours=1))
    assert await holds.confirm_hold(holds_pool, confirmed)

    # Worker A keeps its first batch's transaction (and row locks) open until worker B
    # has committed a batch: B must skip A's locked holds, never wait for them.
    a_holding, b_committed = asyncio.Event(), asyncio.Event()

    async def a_first_batch_waits_for_b() -> None:
        if not a_holding.is_set():
            a_holding.set()
            await asyncio.wait_for(b_committed.wait(), 10)

    async def loop(pool: asyncpg.Pool, name: str) -> int:
        hook = a_first_batch_waits_for_b if name == "a" else None
        if name == "b":
            await a_holding.wait()
        total = 0
        while True:
            done = await holds.expire_due_holds(pool, now, 7, before_commit=hook)
            total += done
            if name == "b":
                b_committed.set()
            if done < 7:
                return total

    pool_a = await db.create_pool(settings, size=1)
    pool_b = await db.create_pool(settings, size=1)
    try:
        a, b = await asyncio.gather(loop(pool_a, "a"), loop(pool_b, "b"))
    finally:
        await pool_a.close()
        await pool_b.close()

    assert a + b == 101 and a >= 7 and b >= 7, (a, b)
    states = await _states(holds_pool)
    assert {states[i] for i in due} == {"expired"}
    assert (states[later], states[confirmed]) == ("held", "confirmed")
    intents = await _intents(holds_pool)
    assert set(intents) == {_key(i) for i in due}
    assert await holds_pool.fetchval("SELECT count(*) FROM deliveries") == 101
    for i, hold_id in enumerate(due):
        intent = intents[_key(hold_id)]
        assert intent["state"] == "pending" and intent["channel"] == "email"
        assert intent["destination"] == f"customer{i}@example.com"
        assert f"#{hold_id} " in intent["payload"]["text"]


async def test_confirm_waits_for_an_expiry_holding_the_lock_then_finds_it_expired(
    holds_pool: asyncpg.Pool,
) -> None:
    now = datetime.now(UTC)
    [hold_id] = await _due_holds(holds_pool, 1, now)
    locked, release = asyncio.Event(), asyncio.Event()

    async def hold_locks() -> None:
        locked.set()
        await asyncio.wait_for(release.wait(), 10)

    expiry = asyncio.create_task(
        holds.expire_due_holds(holds_pool, now, 10, before_commit=hold_locks)
    )
    await asyncio.wait_for(locked.wait(), 10)
    confirm = asyncio.create_task(holds.confirm_hold(holds_pool, hold_id))
    await rs.wait_for(lambda: rs.waiting_on_a_lock(holds_pool), 10, "confirm blocked on the lock")
    assert not confirm.done()
    release.set()
    assert await asyncio.wait_for(expiry, 10) == 1
    assert await asyncio.wait_for(confirm, 10) is False

    assert await _states(holds_pool) == {hold_id: "expired"}
    assert set(await _intents(holds_pool)) == {_key(hold_id)}


async def test_expiry_skips_a_hold_whose_confirmation_is_in_flight_and_adds_no_intent(
    holds_pool: asyncpg.Pool,
) -> None:
    now = datetime.now(UTC)
    [hold_id] = await _due_holds(holds_pool, 1, now)
    async with holds_pool.acquire() as conn:
        confirming = conn.transaction()
        await confirming.start()
        assert await holds.confirm_hold(conn, hold_id)
        # The confirmation holds the row lock, uncommitted: the expiry skips the hold
        # at once instead of waiting (the timeout would fail the test).
        assert await asyncio.wait_for(holds.expire_due_holds(holds_pool, now, 10), 5) == 0
        await confirming.commit()
    # Once committed, the hold is not held any more: later runs leave it alone too.
    assert await holds.expire_due_holds(holds_pool, now, 10) == 0
    assert await _states(holds_pool) == {hold_id: "confirmed"}
    assert await _intents(holds_pool) == {}


async def test_confirm_racing_expiry_ends_confirmed_xor_expired_with_intent_iff_expired(
    settings: Settings, holds_pool: asyncpg.Pool
) -> None:
    confirm_pool = await db.create_pool(settings, size=1)
    outcomes: Counter[str] = Counter()
    try:
        for _ in range(40):
            now = datetime.now(UTC)
            [hold_id] = await _due_holds(holds_pool, 1, now)
            confirmed, expired = await asyncio.gather(
                holds.confirm_hold(confirm_pool, hold_id),
                holds.expire_due_holds(holds_pool, now, 10),
            )
            state = (await _states(holds_pool))[hold_id]
            has_intent = _key(hold_id) in await _intents(holds_pool)
            assert confirmed != bool(expired), (hold_id, confirmed, expired)
            assert state == ("confirmed" if confirmed else "expired")
            assert has_intent == (state == "expired")
            outcomes[state] += 1
    finally:
        await confirm_pool.close()
    assert sum(outcomes.values()) == 40
    expired_ids = {i for i, s in (await _states(holds_pool)).items() if s == "expired"}
    assert set(await _intents(holds_pool)) == {_key(i) for i in expired_ids}


async def test_worker_killed_before_commit_leaves_neither_expiry_nor_intent(
    settings: Settings, holds_pool: asyncpg.Pool
) -> None:
    due = await _due_holds(holds_pool, 5, datetime.now(UTC))

    crashed = await _run_worker(settings, "--batch", "10", **{holds.CRASH_ENV: "1"})
    assert crashed.code == -signal.SIGKILL, (crashed.code, crashed.stderr[-2000:])
    # The worker did write before it died: the intents used delivery ids (sequences are
    # not transactional) ...
    seq = await _one(holds_pool, "SELECT last_value, is_called FROM deliveries_id_seq")
    assert (seq["last_value"], seq["is_called"]) == (5, True)
    # ... but none of it committed.
    assert set((await _states(holds_pool)).values()) == {"held"}
    assert await holds_pool.fetchval("SELECT count(*) FROM deliveries") == 0

    async def dead_session_gone() -> bool:
        left = await holds_pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
        )
        return bool(left == 0)

    await rs.wait_for(dead_session_gone, 10, "the killed worker's session to end")
    again = await _run_worker(settings, "--batch", "10")
    assert (again.code, again.stdout.strip()) == (0, "expired 5 holds"), again.stderr[-2000:]
    assert set((await _states(holds_pool)).values()) == {"expired"}
    assert set(await _intents(holds_pool)) == {_key(i) for i in due}


async def test_committed_expiry_email_is_accepted_once_by_publish_and_consumer(
    settings: Settings, holds_pool: asyncpg.Pool, email_api: FakeEmailApi
) -> None:
    due = await _due_holds(holds_pool, 3, datetime.now(UTC))
    ran = await _run_worker(settings, "--batch", "2")
    assert (ran.code, ran.stdout.strip()) == (0, "expired 3 holds"), ran.stderr[-2000:]

    published = await rs.relay(settings, "publish")
    assert published.code == 0, published.stderr[-2000:]
    assert {r["state"] for r in (await _intents(holds_pool)).values()} == {"queued"}

    email_settings = settings.model_copy(
        update={
            "email_api_key": SecretStr(API_KEY),
            "email_sender": SENDER,
            "email_api_base_url": f"http://127.0.0.1:{email_api.port}",
        }
    )

    # The provider took each one; this one sends no receipts, so accepted is all it knows.
    async def all_accepted() -> bool:
        return set(await rs.states(holds_pool)) == {"accepted"}

    async with rs.consumer_in_process(email_settings):
        await rs.wait_for(all_accepted, 20, "every expiry email accepted by the provider")

    keys = {_key(i) for i in due}
    assert email_api.requests == Counter(dict.fromkeys(keys, 1))
    assert email_api.unauthorized == 0
    for i, hold_id in enumerate(due):
        body = email_api.first_body[_key(hold_id)]
        assert body["from"] == SENDER and body["to"] == [f"customer{i}@example.com"]
        assert body["subject"] == "Your support hold has expired"
        assert f"#{hold_id} " in body["text"]
    intents = await _intents(holds_pool)
    assert {k: r["receipt"] for k, r in intents.items()} == {k: email_api.ids[k] for k in keys}
    assert all(r["attempts"] == 1 for r in intents.values())
