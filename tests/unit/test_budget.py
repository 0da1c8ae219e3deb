"""The shared budget's plan (capacity and spend deadline) and its local token handling.

The plan is checked in exact arithmetic: ``floor(c + rate * (1 + D)) <= floor(rate + burst)``
is the whole promise, so rounding must never be what keeps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consumer import budget
from consumer.budget import BudgetSpec


def _exact_window_bound(spec: BudgetSpec, plan: budget.BucketPlan) -> int:
    """floor(c + r * (1 + D)) in exact arithmetic on the floats' binary values."""
    rate = Fraction(spec.rate_per_second)
    return math.floor(Fraction(plan.capacity) + rate * (1 + Fraction(plan.spend_deadline_seconds)))


rates = st.floats(min_value=0.001, max_value=1e6, allow_nan=False, allow_infinity=False)
bursts = st.floats(min_value=1.0, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(rates, bursts)
def test_every_plan_keeps_any_one_second_within_rate_plus_burst(rate: float, burst: float) -> None:
    spec = BudgetSpec(rate, burst)
    plan = budget.plan_bucket(spec)
    assert _exact_window_bound(spec, plan) <= math.floor(Fraction(rate) + Fraction(burst))
    assert budget.window_limit(spec) <= math.floor(Fraction(rate) + Fraction(burst))
    assert 1.0 <= plan.capacity <= burst
    assert 0 < plan.spend_deadline_seconds <= budget.deadline_cap(rate) <= 1


@given(rates, bursts)
def test_the_room_above_the_rate_is_shared_and_none_is_wasted(rate: float, burst: float) -> None:
    spec = BudgetSpec(rate, burst)
    plan = budget.plan_bucket(spec)
    # Another token of capacity, or another token's worth of deadline (each with the
    # hundredth kept against rounding), would break the promise, unless the capacity is
    # already the whole burst or the deadline at its cap.
    more_capacity = budget.BucketPlan(plan.capacity + 1.02, plan.spend_deadline_seconds)
    more_deadline = budget.BucketPlan(plan.capacity, plan.spend_deadline_seconds + 1.02 / rate)
    limit = budget.window_limit(spec)
    assert plan.capacity + 1.02 > burst or _exact_window_bound(spec, more_capacity) > limit
    at_cap = Fraction(plan.spend_deadline_seconds) == budget.deadline_cap(rate)
    assert at_cap or _exact_window_bound(spec, more_deadline) > limit


@pytest.mark.parametrize(
    ("rate", "burst", "capacity", "deadline_ms"),
    [
        (50, 5, 3, 59.8),  # the test budget: 55 in any second
        (100, 10, 5, 59.9),
        (2000, 100, 50, 25.5),
        (40, 2, 1, 49.75),
        (10, 1, 1, 99.0),  # email's default burst max(1, rate / 10)
        (20, 10, 8, 100.0),  # the deadline's cap: 0.1 s at 10 per second and more
        (1, 1, 1, 990.0),  # below that, up to one token's time ...
        (1 / 12, 1, 1, 1000.0),  # ... and at most 1 s
        (1, 100, 99, 1000.0),  # room beyond the capped deadline goes to the capacity
        (100_000, 10_000, 5000, 50.0),
    ],
)
def test_plan_examples(rate: float, burst: float, capacity: float, deadline_ms: float) -> None:
    plan = budget.plan_bucket(BudgetSpec(rate, burst))
    assert plan.capacity == capacity
    assert plan.spend_deadline_seconds * 1000 == pytest.approx(deadline_ms, abs=0.01)


def test_a_bucket_grants_at_most_its_capacity_plus_what_the_interval_refills() -> None:
    assert budget.max_grants(3, 50, 1.0598) == 55
    assert budget.max_grants(3, 50, 1.06) == 56  # a deadline of 60 ms would be one too many
    assert budget.max_grants(1, 10, 0) == 1


@pytest.mark.parametrize(
    ("capacity", "fraction", "reserve"),
    [(3, 0.2, 1), (1, 0.2, 0), (1.5, 0.2, 1), (50, 0.2, 10), (5, 0.0, 0), (5, 1.0, 4)],
)
def test_urgent_reserve_leaves_bulk_at_least_one_token(
    capacity: float, fraction: float, reserve: float
) -> None:
    assert budget.urgent_reserve(capacity, fraction) == reserve


# ------------------------------------------------------------ local token handling


class _Bucket:
    """Stands in for the pool: the lease_tokens arithmetic on a clock the test moves."""

    def __init__(self, rate: float, tokens: float, *, round_trip_seconds: float = 0.0) -> None:
        self.rate = rate
        self.tokens = tokens
        self.now = 0.0
        self.round_trip_seconds = round_trip_seconds
        # (want, reserve, capacity, granted) of every lease
        self.leases: list[tuple[int, float, float | None, int]] = []
        self.paused_until = 0.0

    def monotonic(self) -> float:
        return self.now

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[_Bucket]:
        yield self  # the pool's connection: this bucket again

    async def execute(self, query: str, *args: Any) -> str:
        if "paused_until" in query:  # pause_budget
            self.paused_until = self.now + float(args[1])
            self.tokens = 0
        return "OK"

    async def fetchrow(
        self, query: str, provider: str, want: int, reserve: float, capacity: float | None
    ) -> dict[str, Any]:
        await asyncio.sleep(0)  # a real round trip always yields to the loop
        self.now += self.round_trip_seconds
        available = min(capacity or math.inf, self.tokens)
        granted = max(0, math.floor(min(want, available - reserve)))
        if self.paused_until > self.now:
            granted = 0
        self.tokens = available - granted
        self.leases.append((want, reserve, capacity, granted))
        paused = max(0.0, self.paused_until - self.now)
        return {
            "granted": granted,
            "available": available,
            "rate": self.rate,
            "paused_seconds": paused,
        }


def _budgets(bucket: _Bucket, spec: BudgetSpec) -> budget.Budgets:
    return budget.Budgets(
        bucket,  # type: ignore[arg-type]
        {"p": spec},
        monotonic=bucket.monotonic,
    )


async def test_a_granted_token_is_spent_when_the_lease_returns_within_the_deadline() -> None:
    bucket = _Bucket(50, 3, round_trip_seconds=0.01)
    budgets = _budgets(bucket, BudgetSpec(50, 5))
    assert await budgets.acquire("p", urgent=False, max_wait_seconds=1)
    # A bulk lease asks within one bucket and leaves the urgent reserve.
    assert bucket.leases[0] == (1, 1.0, 3.0, 1)


async def test_tokens_from_a_lease_slower_than_the_deadline_are_dropped_unspent() -> None:
    bucket = _Bucket(50, 3, round_trip_seconds=0.07)  # deadline 59.8 ms
    budgets = _budgets(bucket, BudgetSpec(50, 5))
    assert not await budgets.acquire("p", urgent=False, max_wait_seconds=0.05)
    assert bucket.leases  # it did lease, and granted tokens were thrown away


async def test_a_waiter_that_runs_after_its_tokens_deadline_does_not_send() -> None:
    bucket = _Bucket(50, 3)
    budgets = _budgets(bucket, BudgetSpec(50, 5))
    results: list[float | None] = []

    async def one() -> None:
        results.append(await budgets.acquire("p", urgent=False, max_wait_seconds=0.05))

    task = asyncio.create_task(one())
    while not bucket.leases:  # the refiller leased and handed the token over
        await asyncio.sleep(0)
    bucket.now += 1.0  # ... and the waiter's task runs a second later
    bucket.tokens = 0  # nothing more to lease
    await task
    assert results == [None]


async def test_urgent_waiters_are_served_before_bulk_and_lease_without_the_reserve() -> None:
    bucket = _Bucket(50, 0)
    budgets = _budgets(bucket, BudgetSpec(50, 5))
    order: list[str] = []

    async def one(name: str, urgent: bool) -> None:
        if await budgets.acquire("p", urgent=urgent, max_wait_seconds=1):
            order.append(name)

    tasks = [asyncio.create_task(one("bulk", False))]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(one("urgent", True)))
    while len(bucket.leases) < 3:  # nothing granted yet: both wait
        await asyncio.sleep(0.001)
    bucket.tokens = 1
    await asyncio.wait_for(asyncio.gather(*[asyncio.shield(t) for t in tasks[1:]]), 1)
    assert order == ["urgent"]
    # The bulk leases left a reserve of one token: only the urgent lease could take it.
    granting = [lease for lease in bucket.leases if lease[3] > 0]
    assert [reserve for _, reserve, _, _ in granting] == [0.0]
    bucket.tokens = 3
    await asyncio.wait_for(tasks[0], 1)
    assert order == ["urgent", "bulk"]


async def test_a_pause_longer_than_the_wait_refuses_at_once_without_a_lease() -> None:
    bucket = _Bucket(50, 3)
    budgets = _budgets(bucket, BudgetSpec(50, 5))
    await budgets.pause("p", 5.0)
    assert not await budgets.acquire("p", urgent=True, max_wait_seconds=1)
    assert bucket.leases == []
