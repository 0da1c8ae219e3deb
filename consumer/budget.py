"""Provider rate budgets shared by every consumer replica.

Worker concurrency is not a rate limit: a provider grants N messages per second to the
account. Each provider's budget is a token bucket in one PostgreSQL row
(``rate_budgets``: rate, burst, tokens, paused_until). A process leases small blocks of
tokens from it (at most ``lease_window_seconds`` worth, only as many as it has waiting
sends) and spends them locally through an ``aiolimiter.AsyncLimiter`` at the provider's
rate, so a block is not fired at once. Leased tokens not spent within
``token_ttl_seconds`` are dropped, which bounds both how far spending can lag the bucket
and how long a throttle pause set by another replica takes to be obeyed.

A throttle answer (429 + Retry-After) pauses the provider's row for every replica.
The urgent lane is served first locally, and bulk leases leave ``reserve`` tokens in the
bucket that only urgent leases may take, so a bulk backlog cannot hold an urgent send.
Waiting never uses an attempt: a send that would wait longer than allowed is deferred
by the caller without counting one.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import asyncpg
from aiolimiter import AsyncLimiter

from service import db


@dataclass(frozen=True)
class BudgetSpec:
    """A provider's budget: messages per second, and how many may go at once after idling."""

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


@dataclass
class _Lease:
    granted: int
    available: float
    rate: float | None
    paused_seconds: float


class _ProviderState:
    def __init__(self, spec: BudgetSpec | None, lease_window_seconds: float) -> None:
        self.spec = spec
        self.urgent: deque[asyncio.Future[None]] = deque()
        self.bulk: deque[asyncio.Future[None]] = deque()
        self.tokens = 0
        self.tokens_expire = 0.0
        self.paused_until = 0.0
        self.refiller: asyncio.Task[None] | None = None
        # Local spending rate, to lease what this process will use before tokens expire
        # (fewer round trips at high rates) without hoarding the shared budget.
        self.spent = 0
        self.rate_since = 0.0
        self.local_rate = 0.0
        self.limiter = (
            AsyncLimiter(
                max(1.0, spec.rate_per_second * lease_window_seconds), lease_window_seconds
            )
            if spec is not None
            else None
        )

    def waiting(self) -> int:
        return len(self.urgent) + len(self.bulk)

    def next_waiter(self) -> asyncio.Future[None] | None:
        for queue in (self.urgent, self.bulk):
            while queue:
                future = queue.popleft()
                if not future.done():  # a waiter that timed out has gone
                    return future
        return None


class Budgets:
    """One per consumer process; ``acquire`` before each send."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        specs: Mapping[str, BudgetSpec],
        *,
        urgent_reserve_fraction: float = 0.2,
        lease_window_seconds: float = 0.02,
        token_ttl_seconds: float = 0.1,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._specs = dict(specs)
        self._reserve_fraction = urgent_reserve_fraction
        self._window = lease_window_seconds
        self._ttl = token_ttl_seconds
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
            state = self._providers.setdefault(
                provider, _ProviderState(self._specs.get(provider), self._window)
            )
        return state

    async def acquire(self, provider: str, *, urgent: bool, max_wait_seconds: float) -> bool:
        """Wait for one token; False if that would take longer than ``max_wait_seconds``."""
        state = self._providers.get(provider) or await self._state(provider)
        now = self._now()
        if state.paused_until - now > max_wait_seconds:
            return False
        if state.tokens > 0 and now < state.tokens_expire and not state.waiting():
            state.tokens -= 1  # fast path: a leased token is at hand and nobody is ahead
            state.spent += 1
        else:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            (state.urgent if urgent else state.bulk).append(future)
            if state.refiller is None or state.refiller.done():
                state.refiller = asyncio.create_task(self._refill(provider, state))
            try:
                async with asyncio.timeout(max_wait_seconds):
                    await future
            except TimeoutError:
                return False
        if state.limiter is not None:
            await state.limiter.acquire()
        return True

    async def pause(self, provider: str, seconds: float) -> None:
        """A throttle answer: stop every replica's sends to this provider for ``seconds``."""
        state = await self._state(provider)
        state.paused_until = max(state.paused_until, self._now() + seconds)
        state.tokens = 0
        await self._pool.execute(db.q("pause_budget"), provider, seconds)

    async def _lease(self, provider: str, want: int, reserve: float) -> _Lease:
        row = await self._pool.fetchrow(db.q("lease_tokens"), provider, want, reserve)
        if row is None:  # the row vanished (reset by an operator): no budget, no pause
            return _Lease(want, float(want), None, 0.0)
        return _Lease(row["granted"], row["available"], row["rate"], row["paused_seconds"])

    async def _refill(self, provider: str, state: _ProviderState) -> None:
        """Hand tokens to waiters (urgent first) until none wait; lease blocks as needed."""
        while state.waiting():
            now = self._now()
            if state.tokens > 0 and now < state.tokens_expire:
                waiter = state.next_waiter()
                if waiter is not None:
                    state.tokens -= 1
                    state.spent += 1
                    waiter.set_result(None)
                continue
            spec = state.spec
            if now > state.rate_since:
                state.local_rate = state.spent / (now - state.rate_since)
            state.spent, state.rate_since = 0, now
            block = math.ceil(spec.rate_per_second * self._window) if spec else 1000
            expected = math.ceil(state.local_rate * self._ttl / 2)
            want = max(1, min(max(state.waiting(), expected), block))
            reserve = 0.0
            if spec is not None and not state.urgent:
                reserve = min(spec.burst - 1, math.ceil(spec.burst * self._reserve_fraction))
            lease = await self._lease(provider, want, reserve)
            if lease.granted > 0:
                state.tokens, state.tokens_expire = lease.granted, self._now() + self._ttl
                continue
            if lease.paused_seconds > 0:
                state.paused_until = self._now() + lease.paused_seconds
                await asyncio.sleep(min(lease.paused_seconds, 0.5))
            elif lease.rate:
                missing = 1 + reserve - lease.available
                await asyncio.sleep(min(max(missing / lease.rate, 0.005), 0.5))
            else:
                await asyncio.sleep(0.005)
