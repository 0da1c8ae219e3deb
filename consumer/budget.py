"""Provider rate budgets shared by every consumer replica, strict in every 1 s window.

Worker concurrency is not a rate limit: a provider grants N messages per second to the
account. Each provider's budget is a token bucket in one PostgreSQL row (``rate_budgets``)
refilled at the provider's rate and holding at most ``capacity`` tokens. A process leases
tokens from it for the sends it has waiting, and a token must be spent (``acquire``
returns) within ``spend_deadline_seconds`` of the moment just before the lease query was
sent, on this process's monotonic clock; a token not spent by then is dropped.

The promise: in every interval of 1 s (any start), the sends to one provider across all
replicas number at most ``floor(rate + burst)``. Why: a bucket of capacity ``c`` refilled
at ``r`` grants at most ``floor(c + r * L)`` tokens in any interval of length ``L``, and
each grant happens between its lease's "before the query" instant and the send, which
is at most ``D`` later; so the sends of a 1 s interval were granted within ``1 + D``
seconds, at most ``floor(c + r * (1 + D))`` of them. ``plan_bucket`` chooses ``c`` and
``D`` so that this is ``<= floor(rate + burst)``. The lease statement stamps each grant
with one database time, never earlier than the previous grant's, so grant times follow
the row lock's order and the bucket's arithmetic is exact however leases interleave.
docs/channels.md states the promise as the receiver sees it, with its one caveat.

A throttle answer (429 + Retry-After) pauses the provider's row for every replica; tokens
leased before the pause are spent within ``D`` at most. The urgent lane is served first
locally, and bulk leases leave ``reserve`` tokens in the bucket that only urgent leases
may take, so a bulk backlog cannot hold an urgent send. Waiting never uses an attempt: a
send that would wait longer than allowed is deferred by the caller without counting one.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction

import asyncpg
from aiolimiter import AsyncLimiter

from service import db, logs

log = logs.get("consumer")

# A provider without a budget (only a throttle pause can stop it): tokens live this long,
# which is how soon another replica's pause is obeyed. (The consumer takes none for such a
# provider: its claim and last check read the pause from the shared row themselves.)
_UNBUDGETED_DEADLINE_SECONDS = 0.1
_UNBUDGETED_BLOCK = 1000
_LEASE_RETRY_SECONDS = 0.5


@dataclass(frozen=True)
class BudgetSpec:
    """A provider's budget: messages per second, and how many more any 1 s may hold."""

    rate_per_second: float
    burst: float


def parse_budgets(text: str) -> dict[str, BudgetSpec]:
    """``"webhook=50/5,email=10"`` -> rate 50/s burst 5, rate 10/s burst max(1, rate/10)."""
    specs: dict[str, BudgetSpec] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        rate_text, _, burst_text = value.partition("/")
        try:
            rate = float(rate_text)
            burst = float(burst_text) if burst_text else max(1.0, rate / 10)
        except ValueError:
            raise ValueError(f"expected provider=rate[/burst], got {part!r}") from None
        if not sep or not name.strip() or rate <= 0 or burst < 1:
            raise ValueError(f"expected provider=rate[/burst] with rate > 0, burst >= 1: {part!r}")
        specs[name.strip()] = BudgetSpec(rate, burst)
    return specs


@dataclass(frozen=True)
class BucketPlan:
    """How the shared bucket of one budget is run.

    ``capacity``: the most tokens the bucket holds (1 <= capacity <= burst).
    ``spend_deadline_seconds``: a leased token is spent within this long after the moment
    just before its lease query was sent, or dropped.
    """

    capacity: float
    spend_deadline_seconds: float


def window_limit(spec: BudgetSpec) -> int:
    """The promise: at most this many sends in any 1 s interval (exact, not rounded up)."""
    return math.floor(Fraction(spec.rate_per_second) + Fraction(spec.burst))


def max_grants(capacity: float, rate_per_second: float, interval_seconds: float) -> int:
    """The most tokens a bucket of ``capacity`` refilled at ``rate_per_second`` grants in
    any interval of ``interval_seconds`` (it may be full when the interval starts)."""
    return math.floor(Fraction(capacity) + Fraction(rate_per_second) * Fraction(interval_seconds))


def deadline_cap(rate_per_second: float) -> Fraction:
    """The longest spend deadline a budget gets: 0.1 s, or one token's time (``1 / rate``)
    up to 1 s for a budget slower than 10 per second.

    ``D`` is also how long a throttle pause set by another replica can take to be obeyed,
    hence a cap. But a token dropped because its lease came back late costs ``1 / rate``
    seconds of sending: at one token every 12 s, a 0.1 s deadline missed once on a loaded
    machine made every waiting send 12 s late. Up to one token's time, a late pause lets
    through at most the tokens already leased, as at any rate.
    """
    return max(Fraction(1, 10), min(Fraction(1), 1 / Fraction(rate_per_second)))


def plan_bucket(spec: BudgetSpec) -> BucketPlan:
    """Choose capacity ``c`` and spend deadline ``D`` with
    ``floor(c + rate * (1 + D)) <= floor(rate + burst)``.

    The room above ``rate`` in a window, ``floor(rate + burst) + 1 - rate`` tokens (less
    a hundredth of a token against rounding), is shared between the two: ``c`` lets
    replicas that lease late (a polling gap) lose no tokens, ``D`` lets a slow lease round
    trip or a busy event loop still spend what was granted. Half each, ``c`` a whole
    number where it can be; ``D`` at most ``deadline_cap(rate)``, any room beyond that
    going to ``c``. A small burst at a high rate leaves a short ``D``: the promise still
    holds, but leases slower than ``D`` waste their tokens (docs/channels.md).
    Computed exactly; the float deadline is rounded down.
    """
    rate, burst = Fraction(spec.rate_per_second), Fraction(spec.burst)
    room = window_limit(spec) - rate  # > 0 because burst >= 1
    margin = min(Fraction(1, 100), room / 2)
    slack = room + 1 - margin  # tokens for c + rate * D
    capacity = min(burst, max(Fraction(1), Fraction(math.floor(slack / 2 + Fraction(1, 2)))))
    deadline = (slack - capacity) / rate
    cap = deadline_cap(spec.rate_per_second)
    if deadline > cap:
        deadline = cap
        capacity = max(capacity, min(burst, Fraction(math.floor(slack - rate * deadline))))
    seconds = float(deadline)
    if Fraction(seconds) > deadline:
        seconds = math.nextafter(seconds, 0.0)
    return BucketPlan(capacity=float(capacity), spend_deadline_seconds=seconds)


def urgent_reserve(capacity: float, fraction: float) -> float:
    """Tokens bulk leases leave in the bucket for urgent ones: ``ceil(capacity * fraction)``,
    never so many that bulk could get none."""
    return float(max(0, min(math.ceil(capacity) - 1, math.ceil(capacity * fraction))))


@dataclass
class _Lease:
    granted: int
    available: float
    rate: float | None
    paused_seconds: float


class _ProviderState:
    def __init__(self, spec: BudgetSpec | None) -> None:
        self.spec = spec
        self.plan = plan_bucket(spec) if spec is not None else None
        # Each waiter's future receives the spend deadline of the token handed to it.
        self.urgent: deque[asyncio.Future[float]] = deque()
        self.bulk: deque[asyncio.Future[float]] = deque()
        self.tokens = 0
        self.tokens_deadline = 0.0
        self.paused_until = 0.0
        self.refiller: asyncio.Task[None] | None = None
        # Local spending rate, to lease what this process will use before tokens expire
        # (fewer round trips at high rates) without hoarding the shared budget.
        self.spent = 0
        self.rate_since = 0.0
        self.local_rate = 0.0
        # A per-replica ceiling at the promised rate (aiolimiter's leaky bucket).
        self.ceiling = AsyncLimiter(window_limit(spec), 1.0) if spec is not None else None

    @property
    def spend_deadline_seconds(self) -> float:
        return self.plan.spend_deadline_seconds if self.plan else _UNBUDGETED_DEADLINE_SECONDS

    def waiting(self) -> int:
        return len(self.urgent) + len(self.bulk)

    def next_waiter(self) -> asyncio.Future[float] | None:
        for queue in (self.urgent, self.bulk):
            while queue:
                future = queue.popleft()
                if not future.done():  # a waiter that timed out has gone
                    return future
        return None


class Budgets:
    """One per consumer process; ``acquire`` immediately before each send."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        specs: Mapping[str, BudgetSpec],
        *,
        urgent_reserve_fraction: float = 0.2,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._specs = dict(specs)
        self._reserve_fraction = urgent_reserve_fraction
        self._now = monotonic
        self._providers: dict[str, _ProviderState] = {}

    async def setup(self) -> None:
        """Write the configured budgets (every replica is configured the same)."""
        for provider, spec in self._specs.items():
            await self._pool.execute(
                db.q("configure_budget"), provider, spec.rate_per_second, spec.burst
            )

    async def _state(self, provider: str) -> _ProviderState:
        state = self._providers.get(provider)
        if state is None:
            if provider not in self._specs:
                await self._pool.execute(db.q("ensure_budget"), provider)
            state = self._providers.setdefault(provider, _ProviderState(self._specs.get(provider)))
        return state

    def rate_limited(self, provider: str) -> bool:
        """Does ``provider`` have a rate budget (else only a throttle pause stops it)?"""
        return provider in self._specs

    def paused_seconds(self, provider: str) -> float:
        """How much longer this process knows ``provider`` to be paused (a throttle)."""
        state = self._providers.get(provider)
        return max(0.0, state.paused_until - self._now()) if state is not None else 0.0

    def at_hand(self, provider: str) -> bool:
        """Would ``acquire`` return at once (a leased token here, nobody ahead)?"""
        state = self._providers.get(provider)
        return (
            state is not None
            and state.tokens > 0
            and self._now() <= state.tokens_deadline
            and not state.waiting()
            and (state.ceiling is None or state.ceiling.has_capacity())
        )

    async def acquire(
        self, provider: str, *, urgent: bool, max_wait_seconds: float
    ) -> float | None:
        """Wait for one token; None if that would take longer than ``max_wait_seconds``.

        Returns the token's spend deadline (this process's monotonic clock): the request
        must go out by then, or the token is void and the caller acquires again. The
        promise counts a send no later than that moment.
        """
        state = self._providers.get(provider) or await self._state(provider)
        now = self._now()
        if state.paused_until - now > max_wait_seconds:
            return None
        if state.ceiling is not None:
            # This replica alone never exceeds the promise, even if the shared row is
            # gone or misconfigured; taken before the token, so it never delays spending.
            try:
                async with asyncio.timeout(max_wait_seconds):
                    await state.ceiling.acquire()
            except TimeoutError:
                return None
        if state.tokens > 0 and now <= state.tokens_deadline and not state.waiting():
            state.tokens -= 1  # fast path: a leased token is at hand and nobody is ahead
            state.spent += 1
            return state.tokens_deadline
        loop = asyncio.get_running_loop()
        queue = state.urgent if urgent else state.bulk
        first = True
        try:
            async with asyncio.timeout(max_wait_seconds):
                while True:
                    future: asyncio.Future[float] = loop.create_future()
                    # A waiter whose token expired before it ran keeps its place in line.
                    if first:
                        queue.append(future)
                        first = False
                    else:
                        queue.appendleft(future)
                    if state.refiller is None or state.refiller.done():
                        state.refiller = asyncio.create_task(self._refill(provider, state))
                    deadline = await future
                    if self._now() <= deadline:
                        return deadline
                    # Handed a token, but this task ran too late to spend it: dropped.
        except TimeoutError:
            return None

    async def close(self) -> None:
        """Stop every refill task (the session is ending: nobody waits for a token)."""
        refillers = [s.refiller for s in self._providers.values() if s.refiller is not None]
        for task in refillers:
            task.cancel()
        await asyncio.gather(*refillers, return_exceptions=True)

    async def pause(self, provider: str, seconds: float) -> None:
        """A throttle answer: stop every replica's sends to this provider for ``seconds``."""
        state = await self._state(provider)
        state.paused_until = max(state.paused_until, self._now() + seconds)
        state.tokens = 0
        await self._pool.execute(db.q("pause_budget"), provider, seconds)

    async def _lease(
        self, provider: str, want: int, reserve: float, capacity: float | None
    ) -> tuple[_Lease, float]:
        """Lease up to ``want`` tokens; also the moment just before the query was sent."""
        async with self._pool.acquire() as conn:
            # Stamped once a connection is at hand, so the deadline does not pay for the
            # wait for one: the grant can only happen after the query is sent.
            sent_at = self._now()
            row = await conn.fetchrow(db.q("lease_tokens"), provider, want, reserve, capacity)
        if row is None:  # the row vanished (reset by an operator): no budget, no pause
            return _Lease(want, float(want), None, 0.0), sent_at
        lease = _Lease(row["granted"], row["available"], row["rate"], row["paused_seconds"])
        return lease, sent_at

    def _want(self, state: _ProviderState, now: float) -> int:
        """How many tokens to ask for: those waiting, or what this process will likely
        spend in half a spend deadline if that is more, within one bucket's worth."""
        if now > state.rate_since:
            state.local_rate = state.spent / (now - state.rate_since)
        state.spent, state.rate_since = 0, now
        expected = math.ceil(state.local_rate * state.spend_deadline_seconds / 2)
        block = max(1, math.floor(state.plan.capacity)) if state.plan else _UNBUDGETED_BLOCK
        return max(1, min(max(state.waiting(), expected), block))

    async def _refill(self, provider: str, state: _ProviderState) -> None:
        """Hand tokens to waiters (urgent first) until none wait; lease as needed."""
        while state.waiting():
            now = self._now()
            if state.tokens > 0 and now <= state.tokens_deadline:
                waiter = state.next_waiter()
                if waiter is not None:
                    state.tokens -= 1
                    state.spent += 1
                    waiter.set_result(state.tokens_deadline)
                continue
            state.tokens = 0  # expired ones are dropped, never carried into a new lease
            want = self._want(state, now)
            reserve = 0.0
            if state.plan is not None and not state.urgent:
                reserve = urgent_reserve(state.plan.capacity, self._reserve_fraction)
            capacity = state.plan.capacity if state.plan else None
            try:
                lease, sent_at = await self._lease(provider, want, reserve, capacity)
            except Exception as exc:
                # The database is away (or the lease failed): waiters time out and defer
                # their sends without an attempt; leasing resumes when it answers.
                level = 30 if db.is_unavailable(exc) else 40
                log.log(
                    level,
                    "rate budget lease failed",
                    extra={"event": "budget_lease_failed", "error": type(exc).__name__},
                )
                await asyncio.sleep(_LEASE_RETRY_SECONDS)
                continue
            if lease.granted > 0:
                state.tokens = lease.granted
                # The deadline runs from before the query: the grant happened after that.
                state.tokens_deadline = sent_at + state.spend_deadline_seconds
                continue
            if lease.paused_seconds > 0:
                state.paused_until = self._now() + lease.paused_seconds
                await asyncio.sleep(min(lease.paused_seconds, 0.5))
            elif lease.rate:
                missing = 1 + reserve - lease.available
                await asyncio.sleep(min(max(missing / lease.rate, 0.001), 0.5))
            else:
                await asyncio.sleep(0.005)
