"""Outcome writes are fenced by (id, attempt), on a real database: a claim that lost its
lease cannot write the row's state, and the grouped write reports back exactly which
(id, attempt) pairs stand, so the stale writer neither acks as written nor dead-letters.
"""

from __future__ import annotations

import asyncio

import asyncpg

from consumer.outage import DatabaseWatch
from consumer.store import Store
from service import ledger, outbox
from service.ledger import Attempt, Completion, State, sending
from tests.support import relay as rs

LEASE_SECONDS = 0.5
_STATE = "SELECT state::text, attempts FROM deliveries WHERE id = $1"


async def _one_row(pool: asyncpg.Pool, key: str = "fence-1") -> int:
    async with pool.acquire() as conn, conn.transaction():
        delivery_id = await outbox.add_intent(
            conn,
            key=key,
            channel="webhook",
            destination="http://127.0.0.1:9/hooks/x",
            allow_networks=rs.LOOPBACK,
            payload={"text": "hi"},
        )
    assert delivery_id is not None
    return delivery_id


async def _claim(pool: asyncpg.Pool, delivery_id: int) -> ledger.Claimed:
    async with pool.acquire() as conn:
        claimed, others = await sending.claim(conn, [delivery_id], LEASE_SECONDS)
    assert delivery_id in claimed, others
    return claimed[delivery_id]


async def _wait_lease_expired(pool: asyncpg.Pool, delivery_id: int) -> None:
    async def expired() -> bool:
        return bool(
            await pool.fetchval(
                "SELECT lease_expires_at <= now() FROM deliveries WHERE id = $1", delivery_id
            )
        )

    await rs.wait_for(expired, 10, "the first claim's lease to expire on the database clock")


async def _claimed_twice(pool: asyncpg.Pool, delivery_id: int) -> tuple[int, int]:
    first = await _claim(pool, delivery_id)
    await _wait_lease_expired(pool, delivery_id)
    second = await _claim(pool, delivery_id)
    assert (first.attempts, second.attempts) == (1, 2)
    assert second.prior_state == "sending"
    return first.attempts, second.attempts


def _stale_dead(delivery_id: int) -> Completion:
    return Completion(
        delivery_id,
        1,
        State.DEAD,
        status=422,
        error="rejected: http 422",
        record=Attempt(outcome="rejected", http_status=422, error="http 422"),
    )


def _current_delivered(delivery_id: int) -> Completion:
    return Completion(
        delivery_id,
        2,
        State.DELIVERED,
        status=200,
        receipt="partner-2",
        record=Attempt(outcome="accepted", http_status=200),
    )


async def _complete(pool: asyncpg.Pool, completions: list[Completion]) -> set[tuple[int, int]]:
    async with pool.acquire() as conn:
        return await sending.complete(conn, completions)


async def test_a_group_with_a_stale_and_a_current_completion_reports_only_the_current_pair(
    pool: asyncpg.Pool,
) -> None:
    delivery_id = await _one_row(pool)
    await _claimed_twice(pool, delivery_id)

    written = await _complete(pool, [_stale_dead(delivery_id), _current_delivered(delivery_id)])

    assert written == {(delivery_id, 2)}
    row = await pool.fetchrow("SELECT * FROM deliveries WHERE id = $1", delivery_id)
    assert (row["state"], row["attempts"], row["last_status"], row["receipt"]) == (
        "delivered",
        2,
        200,
        "partner-2",
    )
    assert row["lease_expires_at"] is None and row["finished_at"] is not None
    attempts = await pool.fetch(
        "SELECT attempt, outcome, http_status FROM delivery_attempts WHERE delivery_id = $1 "
        "ORDER BY attempt",
        delivery_id,
    )
    # The fenced-out send happened, so its attempt row is recorded (replacing the 'lost'
    # placeholder the second claim wrote); only the row's state is the current claim's.
    assert [tuple(a) for a in attempts] == [(1, "rejected", 422), (2, "accepted", 200)]


async def test_the_same_grouped_completion_run_twice_reports_the_same_pairs(
    pool: asyncpg.Pool,
) -> None:
    delivery_id = await _one_row(pool)
    await _claimed_twice(pool, delivery_id)
    group = [_stale_dead(delivery_id), _current_delivered(delivery_id)]

    first = await _complete(pool, group)
    again = await _complete(pool, group)  # a retry after a commit whose answer was lost

    assert first == again == {(delivery_id, 2)}
    row = await pool.fetchrow(_STATE, delivery_id)
    assert tuple(row) == ("delivered", 2)
    count = await pool.fetchval(
        "SELECT count(*) FROM delivery_attempts WHERE delivery_id = $1", delivery_id
    )
    assert count == 2


async def test_the_current_completion_written_first_leaves_the_stale_one_alone(
    pool: asyncpg.Pool,
) -> None:
    delivery_id = await _one_row(pool)
    await _claimed_twice(pool, delivery_id)

    assert await _complete(pool, [_current_delivered(delivery_id)]) == {(delivery_id, 2)}
    assert await _complete(pool, [_stale_dead(delivery_id)]) == set()

    row = await pool.fetchrow(_STATE, delivery_id)
    assert tuple(row) == ("delivered", 2)


async def test_a_stale_completion_with_the_same_state_as_the_current_one_is_not_reported(
    pool: asyncpg.Pool,
) -> None:
    delivery_id = await _one_row(pool)
    await _claimed_twice(pool, delivery_id)
    stale_delivered = Completion(
        delivery_id, 1, State.DELIVERED, status=200, record=Attempt(outcome="accepted")
    )

    written = await _complete(pool, [stale_delivered, _current_delivered(delivery_id)])
    assert written == {(delivery_id, 2)}
    assert await _complete(pool, [stale_delivered]) == set()


async def test_the_consumer_store_maps_a_grouped_result_back_to_each_writer_by_attempt(
    pool: asyncpg.Pool,
) -> None:
    """The code that acks and publishes gets False for the fenced-out writer and True for
    the current one, even when both are flushed in one statement."""
    delivery_id = await _one_row(pool)
    other_id = await _one_row(pool, "fence-2")
    await _claimed_twice(pool, delivery_id)
    other = await _claim(pool, other_id)

    stopping = asyncio.Event()
    watch = DatabaseWatch(
        pool, outage_max_seconds=10, probe_timeout_seconds=5, on_give_up=stopping.set
    )
    store = Store(
        pool, watch, lease_seconds=LEASE_SECONDS, batch_max=10, concurrency=1, stopping=stopping
    )
    store.start()
    flushes: list[int] = []
    flush = store._complete_batch  # count the statements: the three writes share one

    async def counted(completions):  # type: ignore[no-untyped-def]
        flushes.append(len(completions))
        return await flush(completions)

    store._completions._flush = counted  # type: ignore[method-assign]
    try:
        other_done = Completion(
            other_id, other.attempts, State.DELIVERED, record=Attempt(outcome="accepted")
        )
        results = await asyncio.wait_for(
            asyncio.gather(
                store.complete(_stale_dead(delivery_id)),
                store.complete(_current_delivered(delivery_id)),
                store.complete(other_done),
            ),
            10,
        )
    finally:
        await store.close(5)
        await watch.stop()

    assert flushes == [3]
    assert results == [False, True, True]
    states = await pool.fetch("SELECT id, state::text FROM deliveries ORDER BY id")
    assert {r["id"]: r["state"] for r in states} == {
        delivery_id: "delivered",
        other_id: "delivered",
    }
