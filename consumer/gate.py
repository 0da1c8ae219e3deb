"""What a claimed send must pass before its request: circuit, rate budget, a slot of its
destination's share, and enough lease left.

The order matters. A broken destination (circuit open) is refused before it spends any
budget. The destination's slot is taken only for the request itself, never while waiting
for budget, so one provider's backlog cannot crowd out other destinations. The lease is
checked last, because the waits may have eaten it: a request must finish while the claim
still fences the row. Every wait ends at once when shutdown says no request may start
any more (``no_new_requests``): the claim is then given back, not sent.

After ``admit`` the consumer runs its last check (``service.ledger.lastcheck``);
``budget_for_request`` then says whether the request may go out at once or had to wait for
a new token first (and must be checked again after that wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from consumer import budget, isolation
from consumer.channels.base import Outcome, OutcomeKind
from service.ledger import Claimed
from service.telemetry import Metrics

T = TypeVar("T")


@dataclass(frozen=True)
class Defer:
    """Not now: give the claim back and try again after ``seconds``."""

    reason: str
    seconds: float


@dataclass(frozen=True)
class Stopped:
    """Shutdown: no request may start any more."""


class Slot:
    """A slot of one destination's share, held for one request, as a context manager:
    ``with slot:`` around the last check and the request. ``answered`` gives it back as
    soon as the request ended, telling the destination's circuit breaker how (a timeout,
    connection error or 5xx is a failure, any other answer is not); leaving the block
    without an answer (not sent after all, an error, a cancel) gives it back unused, which
    tells the breaker nothing. It is returned exactly once either way.

    ``budget_deadline``: the request must go out by then (monotonic), or its rate-budget
    token is void (None: no budget applies).
    """

    def __init__(
        self, guard: isolation.DestinationGuard, key: str, budget_deadline: float | None
    ) -> None:
        self._guard = guard
        self._key = key
        self._returned = False
        self.budget_deadline = budget_deadline

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()

    def answered(self, outcome: Outcome) -> None:
        """The request ended with ``outcome``: the slot goes back, the circuit hears it."""
        self._give_back(failed=outcome.kind is OutcomeKind.RETRY)

    def release(self) -> None:
        """No request was made with this slot: back unused (a no-op once returned)."""
        self._give_back(failed=None)

    def _give_back(self, *, failed: bool | None) -> None:
        if not self._returned:
            self._returned = True
            self._guard.return_slot(self._key, failed=failed)


class Gate:
    def __init__(
        self,
        *,
        guard: isolation.DestinationGuard,
        budgets: budget.Budgets | None,
        metrics: Metrics,
        lease_seconds: float,
        send_timeout_seconds: float,
        budget_max_wait_seconds: float,
        budget_defer_seconds: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._guard = guard
        self._budgets = budgets
        self._metrics = metrics
        self._lease_seconds = lease_seconds
        self._send_timeout = send_timeout_seconds
        self._budget_max_wait = budget_max_wait_seconds
        self._budget_defer = budget_defer_seconds
        self._now = monotonic

    async def admit(
        self,
        row: Claimed,
        *,
        claimed_at: float,
        no_new_requests: asyncio.Event,
        before_wait: Callable[[], Awaitable[None]] | None = None,
    ) -> Slot | Defer | Stopped:
        """Wait until ``row`` may be sent; the slot to hold during its request, or why not.

        ``claimed_at`` is the monotonic time taken before the claim (its lease ends no
        earlier than ``claimed_at + lease_seconds``). ``before_wait`` runs before the first
        wait (for budget or a slot), if any.
        """
        assert row.destination is not None
        key = isolation.destination_key(row.channel, row.provider, row.destination)
        refused = self._guard.check_circuit(key)
        if not refused.admitted:
            return Defer(refused.reason, refused.retry_after_seconds)
        budget_deadline = None
        # A token at hand is taken after the last check (``budget_for_request``), so the
        # check's round trip does not age it; only a send that must wait takes one here.
        # A provider without a rate budget takes none: its pause is read by the checks.
        if self.rate_limited(row.provider) and not self._budgets_at_hand(row.provider):
            if before_wait is not None:
                await before_wait()
            got = await self._budget(row, no_new_requests)
            if not isinstance(got, float):
                return got
            budget_deadline = got
        # Usually a slot is free: take it without a task or a wait.
        admission: isolation.Admission | Stopped = self._guard.try_take_slot(key)
        if isinstance(admission, isolation.Admission) and not admission.admitted:
            if before_wait is not None:
                await before_wait()
            admission = await _unless(no_new_requests, self._guard.take_slot(key))
        if isinstance(admission, Stopped):
            return admission
        if not admission.admitted:
            return Defer(admission.reason, admission.retry_after_seconds)
        slot = Slot(self._guard, key, budget_deadline)
        lease_left = self._lease_seconds - (self._now() - claimed_at)
        if lease_left <= self._send_timeout:
            # Sending now could outlive the claim and overlap another claim of the row.
            slot.release()
            return Defer("lease too short after waiting", self._budget_defer)
        if no_new_requests.is_set():
            slot.release()
            return Stopped()
        return slot

    async def _budget(
        self, row: Claimed, no_new_requests: asyncio.Event
    ) -> float | Defer | Stopped:
        """Wait for a rate-budget token: its spend deadline, or why not."""
        assert self._budgets is not None
        started = self._now()
        acquiring = self._budgets.acquire(
            row.provider, urgent=row.urgent, max_wait_seconds=self._budget_max_wait
        )
        if self._budgets.at_hand(row.provider):
            got: float | Stopped | None = await acquiring  # a token is here: no wait
        else:
            got = await _unless(no_new_requests, acquiring)
        waited = self._now() - started
        if waited > 0.001:  # recorded when a send actually waited for budget
            labels = {"channel": row.channel, "provider": row.provider}
            self._metrics.budget_wait.record(waited, labels)
        if got is None:
            return Defer("rate budget exhausted or paused", self._budget_defer)
        return got

    def rate_limited(self, provider: str) -> bool:
        """Does ``provider`` have a rate budget (whose tokens also carry its pause)?"""
        return self._budgets is not None and self._budgets.rate_limited(provider)

    def _budgets_at_hand(self, provider: str) -> bool:
        return self._budgets is not None and self._budgets.at_hand(provider)

    def lease_short(self, lease_left_seconds: float) -> Defer | None:
        """The lease left (by the last check, on the database's clock) cannot cover a
        request: defer it rather than let it outlive the claim. None: enough left."""
        if lease_left_seconds <= self._send_timeout:
            return Defer("lease too short after waiting", self._budget_defer)
        return None

    async def budget_for_request(
        self,
        row: Claimed,
        slot: Slot,
        no_new_requests: asyncio.Event,
        *,
        before_wait: Callable[[], Awaitable[None]] | None,
    ) -> Defer | Stopped | bool:
        """After a passed last check, right before the request: a valid budget token.

        True: send now. A token taken while waiting is still valid; or one is at hand,
        taken now without suspending (no other task runs in between, so nothing sits
        between the last check and the request); or the provider has no rate budget (no
        token: its throttle pause is read by the claim and the last check from the shared
        row, and this replica's own is read here). False: a token had to be waited for
        (``before_wait``, if any, ran first): the row must be checked again.
        """
        if slot.budget_deadline is not None and self._now() <= slot.budget_deadline:
            return True
        if self._budgets is None:
            return True
        if not self._budgets.rate_limited(row.provider):
            paused = self._budgets.paused_seconds(row.provider)
            return Defer("rate budget exhausted or paused", paused) if paused > 0 else True
        at_hand = self._budgets.at_hand(row.provider)
        if not at_hand and before_wait is not None:
            await before_wait()
        got = await self._budget(row, no_new_requests)
        if not isinstance(got, float):
            return got
        slot.budget_deadline = got
        return at_hand


async def _unless(stop: asyncio.Event, waiting: Awaitable[T]) -> T | Stopped:
    """Await ``waiting``, unless ``stop`` is set first: then cancel it and say so."""
    task = asyncio.ensure_future(waiting)
    if stop.is_set():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Stopped()
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Stopped()
    return task.result()
