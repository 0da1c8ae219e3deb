"""The consumer's statements on the ledger: grouped where hot, each one outage-proof.

Claims, last checks and outcome writes happen thousands of times a second, so each is
submitted to a ``Batcher`` and concurrent ones share one statement. Every statement runs
through the ``DatabaseWatch``: an unreachable database makes it wait, not fail. The
functions themselves are ``service.ledger``'s; this module only decides how they run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from consumer.outage import DatabaseWatch
from service import destinations, reconciliations
from service.batching import Batcher
from service.ledger import Claimed, Completion, State, Unclaimable, lastcheck, sending, settlement
from service.ledger.lastcheck import LastCheck

ClaimResult = Claimed | Unclaimable | None


class Stamp:
    """A claim's ``last_check_at``: set by the claim (which read every send fact: the
    row's last check until its send waits) and by each last check; taken back before a
    wait, so that an operator's cancel meanwhile moves the row instead of finding it on
    the wire."""

    def __init__(self, store: Store, delivery_id: int, attempt: int) -> None:
        self._store = store
        self._claim = (delivery_id, attempt)
        self.held = True  # the claim stamped it

    async def undo(self) -> None:
        if self.held:
            self.held = False
            await self._store.undo_check(*self._claim)


class Store:
    """One per consumer process. ``start()`` before use, ``close()`` at the end."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        watch: DatabaseWatch,
        *,
        lease_seconds: float,
        batch_max: int,
        concurrency: int,
        stopping: asyncio.Event,
        linger_seconds: float = 0.0,
    ) -> None:
        self._pool = pool
        self._watch = watch
        self._lease_seconds = lease_seconds
        self._stopping = stopping
        # Claims and outcomes come once per delivery: at a trickle they linger for company.
        self._claims: Batcher[int, ClaimResult] = Batcher(
            self._claim_batch,
            max_size=batch_max,
            max_concurrent=concurrency,
            linger_seconds=linger_seconds,
        )
        self._checks: Batcher[tuple[int, int], LastCheck | None] = Batcher(
            self._check_batch, max_size=batch_max, max_concurrent=concurrency
        )
        self._undos: Batcher[tuple[int, int], None] = Batcher(
            self._undo_batch, max_size=batch_max, max_concurrent=concurrency
        )
        self._completions: Batcher[Completion, bool] = Batcher(
            self._complete_batch,
            max_size=batch_max,
            max_concurrent=concurrency,
            linger_seconds=linger_seconds,
        )

    def start(self) -> None:
        for batcher in self._batchers():
            batcher.start()

    def stop_claims(self) -> None:
        """Shutdown: claim nothing more; claims not yet sent to the database fail."""
        self._claims.stop_intake("stopping")

    async def close(self, timeout_seconds: float) -> None:
        """Flush what was submitted within the deadline, then stop."""
        await asyncio.gather(*(b.close(timeout_seconds) for b in self._batchers()))

    def _batchers(self) -> list[Batcher[Any, Any]]:
        return [self._claims, self._checks, self._undos, self._completions]

    # ---------------------------------------------------------------- one item each

    async def claim(self, delivery_id: int) -> ClaimResult:
        """Claim one row: the row held for sending, why it cannot be, or None (no row)."""
        return await self._claims.submit(delivery_id)

    async def last_check(self, delivery_id: int, attempt: int) -> LastCheck | None:
        """The row checked (and, if still held, stamped) right before its request, after
        every wait (None: the row is gone)."""
        return await self._checks.submit((delivery_id, attempt))

    def stamp(self, row: Claimed) -> Stamp:
        """The stamp the claim of ``row`` set."""
        return Stamp(self, row.id, row.attempts)

    async def undo_check(self, delivery_id: int, attempt: int) -> None:
        """The request must wait again after its check passed: not on the wire meanwhile."""
        await self._undos.submit((delivery_id, attempt))

    async def complete(self, completion: Completion) -> bool:
        """Write one outcome; False if the claim was fenced out by another one."""
        return await self._completions.submit(completion)

    async def release(self, delivery_id: int, attempt: int, retry_at: datetime | None) -> bool:
        """Give a claim back without counting an attempt (at shutdown: only if quick)."""
        return await self._watch.run(
            lambda: sending.release(self._pool, delivery_id, attempt, retry_at),
            abandon=self._stopping,
        )

    async def reconcile_candidates(self, delivery_id: int, attempt: int) -> list[int]:
        """Earlier attempts that may have reached the provider unanswered (none: send)."""
        return await self._watch.run(
            lambda: reconciliations.candidates(self._pool, delivery_id, attempt)
        )

    async def record_reconciliation(self, found: reconciliations.Reconciliation) -> None:
        await self._watch.run(lambda: reconciliations.record(self._pool, found))

    async def mark_dead_lettered(self, delivery_id: int, attempt: int) -> None:
        await self._watch.run(lambda: sending.mark_dead_lettered(self._pool, delivery_id, attempt))

    async def disable_gone(self, destination: str) -> int | None:
        """A 410 Gone: the destination is disabled; its id if this call disabled it."""

        async def statement() -> int | None:
            async with self._pool.acquire() as conn:
                return await destinations.disable_gone(conn, destination)

        return await self._watch.run(statement)

    async def destination_failed(
        self, destination: str, failures: int, span_seconds: float
    ) -> destinations.Streak | None:
        return await self._watch.run(
            lambda: destinations.record_failure(
                self._pool, destination, failures=failures, span_seconds=span_seconds
            )
        )

    async def destination_succeeded(self, destination: str) -> None:
        await self._watch.run(lambda: destinations.record_success(self._pool, destination))

    # ---------------------------------------------------------------- grouped flushes

    async def _claim_batch(self, ids: Sequence[int]) -> list[ClaimResult]:
        unique = list(dict.fromkeys(ids))

        async def statement() -> tuple[dict[int, Claimed], dict[int, Unclaimable]]:
            async with self._pool.acquire() as conn:
                return await sending.claim(conn, unique, self._lease_seconds)

        # During shutdown a claim gives up rather than wait out an outage: its message is
        # handed back untouched.
        claimed, others = await self._watch.run(statement, abandon=self._stopping)
        # A duplicate id within one batch gets the claim once; its twin sees it as held.
        results: list[ClaimResult] = []
        given: set[int] = set()
        for i in ids:
            row = claimed.get(i)
            if row is not None and i not in given:
                given.add(i)
                results.append(row)
            elif row is not None:
                now = datetime.now(UTC)
                lease_end = now + timedelta(seconds=self._lease_seconds)
                results.append(Unclaimable(i, State.SENDING, None, lease_end, now))
            else:
                results.append(others.get(i))
        return results

    async def _check_batch(self, claims: Sequence[tuple[int, int]]) -> list[LastCheck | None]:
        found = await self._watch.run(lambda: lastcheck.last_checks(self._pool, claims))
        return [found.get(c) for c in claims]

    async def _undo_batch(self, claims: Sequence[tuple[int, int]]) -> list[None]:
        await self._watch.run(lambda: lastcheck.undo(self._pool, claims))
        return [None] * len(claims)

    async def _complete_batch(self, completions: Sequence[Completion]) -> list[bool]:
        accepted = [c.id for c in completions if c.state is State.ACCEPTED]

        async def statement() -> set[tuple[int, int]]:
            async with self._pool.acquire() as conn:
                if not accepted:
                    return await sending.complete(conn, completions)
                # A receipt may have come before this outcome: settle by it in the same
                # transaction (``service.ledger.settlement`` says why nothing is missed).
                async with conn.transaction():
                    written = await sending.complete(conn, completions)
                    await settlement.settle(conn, accepted)
                return written

        written = await self._watch.run(statement)
        return [(c.id, c.attempt) in written for c in completions]
