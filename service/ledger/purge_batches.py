"""One ``relay purge`` run's shared state and its batch loop (``service.ledger.purge`` runs the
steps): the pace, giving way to due deliveries, each batch's counts recorded in its own
transaction, and the keyset loop every delivery, run and event step pages with."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg

from service import ledger, logs
from service.crashpoints import CrashPoints
from service.db import q
from service.pacing import Pacer, Yielder
from service.progress import Progress
from service.retention import Cutoffs, PurgeSummary

log = logs.get("purge")
_EPOCH = datetime.min.replace(tzinfo=UTC)  # before any row: the keyset's start
# A row the content step passes over counts this much against the cap: it is only read
# (~3-5 us against ~90 us per delivery deleted, 40,000 rows; docs/benchmarks.md).
_PASSED_OVER_WEIGHT = 0.1


@dataclass
class PurgeRun:
    """What the steps of one run share."""

    conn: ledger.Connection
    summary: PurgeSummary
    cutoffs: Cutoffs
    batch_size: int
    progress: Progress | None
    crash: CrashPoints
    pacer: Pacer
    yielder: Yielder

    @property
    def dry(self) -> bool:
        return self.summary.dry_run

    async def paced(self, rows: float) -> None:
        """After a committed batch of the step's ``rows`` (outside any transaction): sleep
        as long as the cap asks."""
        if await self.pacer.done(rows):
            self.summary.paced_seconds = self.pacer.paced_seconds

    async def give_way(self) -> None:
        """Before a batch: while deliveries are due, wait (up to the run's bound in all)."""
        if waited := await self.yielder.wait():
            self.summary.yielded_seconds = self.yielder.waited_seconds
            log.info("purge waited for due deliveries", extra={
                "event": "purge_yielded", "seconds": round(waited, 3),
                "bound_spent": self.yielder.spent})  # fmt: skip

    async def due_work(self) -> bool:
        """Deliveries are due and not settled (the Yielder's probe; shown while waiting)."""
        due = bool(await self.conn.fetchval(q("purge_due_work")))
        if due and self.progress is not None:
            self.progress.update(self.summary.total, note="waiting: deliveries are due")
        return due

    async def record(self, counts: Sequence[tuple[str, str, int]]) -> None:
        """One batch's counts (table, kind, rows): into the summary and, applied, into the
        run's record and the totals, in the batch's own transaction (the caller's)."""
        for table, kind, n in counts:
            self.summary.add(kind, table, n)
        self.summary.batches += 1
        if self.progress is not None:
            self.progress.update(self.summary.total, note="" if self.dry else self.summary.pace())
        if self.dry or self.summary.run_id is None:
            return
        kept = [(t, k, n) for t, k, n in counts if n]
        keys = [f"{t}/{k}" for t, k, _ in kept]
        ns = [n for _, _, n in kept]
        await self.conn.execute(q("purge_run_progress"), self.summary.run_id, keys, ns)
        await self.conn.execute(
            q("purge_totals_add"), [t for t, _, _ in kept], [k for _, k, _ in kept], ns
        )


# --- one step: pick a page (keyset, no lock), change it in one transaction ----------------

Pick = Callable[[datetime, int], Awaitable[list[asyncpg.Record]]]
Change = Callable[[list[int]], Awaitable[Sequence[tuple[str, str, int]]]]
Count = Callable[[list[int]], Awaitable[Sequence[tuple[str, str, int]]]]


async def batched(
    run: PurgeRun, name: str, pick: Pick, change: Change, count: Count, crash_point: str = ""
) -> None:
    """Page through ``pick``'s candidates; apply ``change`` to each page in a transaction
    (a dry run: ``count`` them). A row the pick marks ``passed_over`` moves the keyset on
    and is left alone. Logs the step's totals."""
    after: tuple[datetime, int] = (_EPOCH, 0)
    done: dict[str, int] = {}
    run.pacer.restart()
    while True:
        await run.give_way()
        page = await pick(after[0], after[1])
        if not page:
            break
        after = (page[-1][1], page[-1][0])
        ids = [r[0] for r in page if not r.get("passed_over")]
        counts: Sequence[tuple[str, str, int]] = []
        if ids and run.dry:
            counts = await count(ids)
            await run.record(counts)
        elif ids:
            async with run.conn.transaction():
                counts = await change(ids)
                await run.record(counts)
            if crash_point:
                run.crash.hit(crash_point)
        if not run.dry:
            await run.paced(len(ids) + (len(page) - len(ids)) * _PASSED_OVER_WEIGHT)
        for table, kind, n in counts:
            done[f"{table}/{kind}"] = done.get(f"{table}/{kind}", 0) + n
        if len(page) < run.batch_size:
            break
    logged(run, name, done)


def logged(run: PurgeRun, step: str, counts: dict[str, int]) -> None:
    paced = round(run.pacer.window_paced_seconds, 3)
    log.info("purge step", extra={"event": "purge_step", "step": step, "counts": counts,
                                  "dry_run": run.dry, "paced_seconds": paced})  # fmt: skip
