"""``relay publish``: one discovery run (a CronJob), and the rescue pass it ends with.

1. Admission, in bounded batches, one transaction each: lock due reminders with
   ``FOR UPDATE SKIP LOCKED``, plan their owed occurrences, insert one ledger row per
   occurrence (``ON CONFLICT DO NOTHING`` on the idempotency key), advance
   ``next_due_at``. Commit.
2. Publish the batch's new rows with publisher confirms, pipelined and bounded, and
   mark only confirmed rows ``queued``.
3. Sweep rows still ``pending`` from earlier runs or from the outbox API, page by page.
4. Rescue: republish rows whose message should have arrived long ago.

Memory holds at most three batches (one being admitted, two being published), however
many reminders are due. A crash anywhere
leaves rows ``pending`` (or stranded ``queued``) for the next run to publish.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import socket
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import asyncpg
from opentelemetry import trace

from publisher.plan import plan_batch
from publisher.results import RunCounts, RunResult
from service import amqp, brokers, db, errors, logs, publishing, runs, signals, telemetry
from service.clock import Clock
from service.crashpoints import CrashPoints
from service.ledger import State, admission, publication, publish_runs, recovery
from service.progress import Progress
from service.settings import Settings
from service.telemetry import Metrics

log = logs.get("publisher")

_CLOSE_SECONDS = 5.0
# Admitted batches being published at once: two keep the broker's confirm window full
# across a batch boundary; more would only hold more rows in memory.
_BATCHES_PUBLISHING = 2


class PublishRun:
    """One run. ``publisher`` is None when the broker was unreachable: admission still
    records what is owed, and the run ends incomplete with those rows pending."""

    def __init__(
        self,
        *,
        settings: Settings,
        pool: asyncpg.Pool,
        publisher: publishing.ConfirmedPublisher | None,
        metrics: Metrics,
        clock: Clock,
        broker_error: str | None = None,
        tracer: trace.Tracer | None = None,
        count_waiting: Callable[[], Awaitable[int]] | None = None,
        crash: CrashPoints | None = None,
    ) -> None:
        self._tracer = tracer or telemetry.noop_tracer()
        self._headers: dict[str, Any] = {}
        self._settings = settings
        self._pool = pool
        self._lock = publish_runs.RunLock(pool)
        self._publisher = publisher
        self._metrics = metrics
        self._clock = clock
        self._error = broker_error
        self._count_waiting = count_waiting
        self._crash = crash or CrashPoints()
        self._broker_unreachable = broker_error is not None
        self.counts = RunCounts()
        # Rows this run could not publish, each once: the pending sweep tries again rows
        # whose publish failed during admission, and a second failure is the same row.
        self._left_pending: set[int] = set()
        self.run_id = 0
        self.result: RunResult | None = None  # once the run's end is recorded
        self._paused: list[tuple[datetime, datetime]] = []  # windows admission was paused

    async def execute(
        self, intended_fire_at: datetime | None = None, *, rescue_only: bool = False
    ) -> RunResult:
        """Run admission, the pending sweep and rescue (or, ``rescue_only``, just rescue).

        The run is one span; its context rides in every message's headers, so each
        delivery attempt's span joins the run's trace.
        """
        name = "relay rescue run" if rescue_only else "relay publish run"
        with self._tracer.start_as_current_span(name) as span:
            result = await self._execute(intended_fire_at, rescue_only=rescue_only)
            span.set_attribute("relay.run_id", result.run_id)
            span.set_attribute("relay.run.status", result.status)
            for counted, value in result.counts.__dict__.items():
                span.set_attribute(f"relay.run.{counted}", value)
            return result

    async def _execute(self, intended_fire_at: datetime | None, *, rescue_only: bool) -> RunResult:
        # A connection out of the pool for the run's life: its lock tells later runs this
        # one is alive.
        async with self._lock:
            return await self._recorded(intended_fire_at, rescue_only=rescue_only)

    async def _recorded(self, intended_fire_at: datetime | None, *, rescue_only: bool) -> RunResult:
        self._headers = telemetry.inject_headers()
        now = self._clock.now()
        # Without a scheduled time from the caller, the run is as late as the oldest
        # occurrence it is about to fire: that is the lag a reminder's receiver sees.
        oldest_due = await admission.oldest_due(self._pool, now)
        intended = intended_fire_at or min(oldest_due or now, now)
        kind = "rescue" if rescue_only else "publish"
        started = await self._lock.start(kind, intended, socket.gethostname())
        self.run_id = started.run_id
        self._metrics.scheduler_lag.record(max((started.started_at - intended).total_seconds(), 0))
        fields = {"event": "publish_run", "run_id": self.run_id}
        paused = not rescue_only and await runs.admission_paused(self._pool)
        if paused:
            # Pause stops admission of scheduled occurrences only. What is already owed
            # (outbox intents committed with application state, pending rows, lost
            # messages) is still relayed: it was promised before the pause.
            log.info("admission paused; no occurrences admitted", extra=fields)
        try:
            if not rescue_only:
                if not paused:
                    self._paused = await runs.pause_windows(self._pool, oldest_due or now)
                    await self._admit_all(now)
                await self._sweep_pending()
            await self._rescue()
        except (OSError, asyncpg.PostgresError) as exc:
            self._error = f"database error: {type(exc).__name__}"
            await self._finish_safely("failed")
            raise
        except asyncio.CancelledError:
            # A stop signal (run() below): what was confirmed is queued, the rest pending
            # for the next run; the record says so instead of staying 'running'.
            self._error = "stopped by a signal before it finished"
            await self._finish_safely("interrupted")
            raise
        status = "ok" if self._error is None and self.counts.failed == 0 else "incomplete"
        if paused and status == "ok":
            status = "paused"
        return await self._finish(status)

    async def _admit_all(self, now: datetime) -> None:
        # Batches are published while the next is admitted, and a batch's publishes start
        # while the one before waits for its last confirms: the window of unconfirmed
        # publishes (RELAY_PUBLISH_MAX_IN_FLIGHT) stays full instead of draining to zero
        # at every batch's end. At most _BATCHES_PUBLISHING batches in memory at once.
        publishing: collections.deque[asyncio.Task[None]] = collections.deque()
        try:
            while (ready := await self._admit_batch(now)) is not None:
                if len(publishing) == _BATCHES_PUBLISHING:
                    await publishing.popleft()
                # Committed first, then published: a crash here leaves the rows pending.
                self._crash.hit("publish_after_admit")
                publishing.append(asyncio.create_task(self._publish(ready)))
        except asyncio.CancelledError:
            for task in publishing:  # stopped: no batch waits on for its confirms
                task.cancel()
            raise
        finally:
            # Every batch's publishes end before the run goes on (or fails): none is left
            # running unawaited, and the first failure is the one raised.
            outcomes = await asyncio.gather(*publishing, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome

    async def _admit_batch(self, now: datetime) -> list[tuple[int, bool, datetime]] | None:
        """Admit one batch in one transaction; its new pending rows, or None if none due."""
        await self._lock.keep()
        async with self._pool.acquire() as conn, conn.transaction():
            horizon = now + timedelta(seconds=self._settings.publish_lookahead_seconds)
            limit = self._settings.publish_batch_size
            rows = await admission.lock_due_reminders(conn, horizon, limit)
            if not rows:
                return None
            new, advances = plan_batch(rows, now, self._settings, self._paused)
            inserted = await admission.insert_deliveries(conn, new, self.run_id)
            await admission.advance_reminders(conn, advances)
        self.counts.due += len(new)
        self.counts.created += len(inserted)
        self.counts.skipped += sum(1 for row in inserted if row.state is State.SKIPPED)
        self._metrics.run_due.add(len(new))
        self._metrics.run_created.add(len(inserted))
        return [(r.id, r.urgent, r.occurrence_at) for r in inserted if r.state is State.PENDING]

    async def _sweep_pending(self) -> None:
        after_id = 0
        while self._publisher is not None:
            await self._lock.keep()
            page = await publication.select_pending(
                self._pool, after_id, self._settings.publish_batch_size
            )
            if not page:
                return
            after_id = page[-1][0]
            await self._publish(page)

    async def _rescue(self) -> None:
        if self._publisher is None:
            return
        await self._lock.keep()
        rows = await recovery.select_rescue(
            self._pool, self._settings.rescue_after_seconds, self._settings.rescue_batch_limit
        )
        if not rows:
            return
        if self._count_waiting is not None:
            # Rescue republishes only what the queues lack: consumers that are down
            # leave every row's message waiting, and copying them again would only
            # pile duplicates behind them.
            owed = await recovery.open_owed_count(self._pool)
            waiting = await self._count_waiting()
            room = max(0, owed - waiting)
            if room < len(rows):
                log.info(
                    "rescue capped: the queues already hold most owed messages",
                    extra={"event": "rescue_capped", "owed": owed, "waiting": waiting},
                )
                rows = rows[:room]
            if not rows:
                return
        progress = Progress("rescue")  # on stderr, only when it is a terminal
        progress.update(0, len(rows))
        confirmed, failed = await self._publisher.publish_many(rows, self._headers)
        progress.update(len(rows), len(rows))
        progress.finish()
        await recovery.mark_rescued(self._pool, confirmed)
        self.counts.rescued += len(confirmed)
        self._tried(confirmed, failed)
        self._metrics.rescues.add(len(confirmed))
        log.warning(
            "rescued deliveries whose message was presumed lost",
            extra={
                "event": "rescue",
                "run_id": self.run_id,
                "rescued": len(confirmed),
                "failed": len(failed),
            },
        )

    async def _publish(self, items: list[tuple[int, bool, datetime]]) -> None:
        """Publish rows so each reaches its lane when it falls due (those admitted ahead
        through the timer ladder), soonest due first, and mark confirmed ones queued."""
        publisher = self._publisher  # two batches publish at once: either may drop it
        if not items:
            return
        if publisher is None:
            self._tried([], [i for i, _, _ in items])
            return
        now = self._clock.now()
        due = sorted(
            ((i, urgent, (at - now).total_seconds()) for i, urgent, at in items),
            key=lambda item: item[2],
        )
        confirmed, failed = await publisher.publish_many(due, self._headers)
        await publication.mark_queued(self._pool, confirmed)
        self.counts.published += len(confirmed)
        self._tried(confirmed, failed)
        self._metrics.run_published.add(len(confirmed))
        if failed:
            self._error = self._error or "some publishes were not confirmed"
            log.warning(
                "publishes not confirmed; rows left pending",
                extra={"event": "publish_failed", "run_id": self.run_id, "failed": len(failed)},
            )
            if publisher.closed:
                self._publisher = None  # broker gone: stop trying, leave the rest pending

    def _tried(self, confirmed: list[int], failed: list[int]) -> None:
        self._left_pending.difference_update(confirmed)
        self._left_pending.update(failed)
        self.counts.failed = len(self._left_pending)

    async def _finish(self, status: str) -> RunResult:
        c = self.counts
        await self._lock.keep()  # a run marked 'interrupted' meanwhile records its own end
        await publish_runs.finish(
            self._pool,
            self.run_id,
            status,
            due=c.due,
            created=c.created,
            skipped=c.skipped,
            published=c.published,
            rescued=c.rescued,
            failed=c.failed,
            error=self._error,
        )
        extra: dict[str, Any] = {
            "event": "publish_run_finished",
            "run_id": self.run_id,
            "status": status,
            **{f"{name}_count": n for name, n in c.__dict__.items()},
        }
        log.info("publish run finished", extra=extra)
        self.result = RunResult(self.run_id, status, c, self._error, self._broker_unreachable)
        return self.result

    async def _finish_safely(self, status: str) -> None:
        try:
            await self._finish(status)
        except (OSError, asyncpg.PostgresError):
            log.error("could not record the run's end", extra={"event": "run_record_failed"})


async def run(
    settings: Settings,
    *,
    metrics: Metrics,
    clock: Clock,
    intended_fire_at: datetime | None = None,
    rescue_only: bool = False,
    tracer: trace.Tracer | None = None,
) -> RunResult:
    """Composition root of ``relay publish`` (and ``relay rescue``).

    SIGTERM or SIGINT (a Job's deadline, ``kubectl delete``, Ctrl-C) stops the run where it
    is: it records itself ``interrupted`` with its counts, and what it did not publish
    stays pending for the next run.
    """
    publish_run: PublishRun | None = None
    with signals.cancelling_on_signals():
        async with contextlib.AsyncExitStack() as stack:
            publish_run = await _compose(stack, settings, metrics, clock, tracer)
            return await publish_run.execute(intended_fire_at, rescue_only=rescue_only)
    log.warning("stopped by a signal", extra={"event": "publish_run_stopped"})
    if publish_run is None or publish_run.result is None:  # stopped before it recorded
        return RunResult(getattr(publish_run, "run_id", 0), "interrupted", error="stopped")
    return publish_run.result  # recorded 'interrupted', with its counts


async def _compose(
    stack: contextlib.AsyncExitStack,
    settings: Settings,
    metrics: Metrics,
    clock: Clock,
    tracer: trace.Tracer | None,
) -> PublishRun:
    # One connection more than the run's work uses: it holds the run's lock (_execute).
    pool = await db.create_pool(settings, size=3)
    stack.push_async_callback(db.close_pool, pool, _CLOSE_SECONDS)
    publisher = None
    broker_error = None
    count_waiting = None
    try:
        connection, publisher = await publishing.open_publisher(settings, "relay-publish")
    except errors.UnavailableError as exc:
        broker_error = str(exc)
        log.error(
            "broker unreachable; admitting without publishing",
            extra={"event": "broker_unreachable"},
        )
    else:
        stack.push_async_callback(amqp.close_connection, connection, _CLOSE_SECONDS)
        count_waiting = functools.partial(
            brokers.ready_total,
            connection,
            amqp.Topology.from_settings(settings).waiting_queues(),
            settings.amqp_timeout_seconds,
        )
    return PublishRun(
        settings=settings,
        pool=pool,
        publisher=publisher,
        metrics=metrics,
        clock=clock,
        broker_error=broker_error,
        tracer=tracer,
        count_waiting=count_waiting,
        crash=CrashPoints(settings.crash_at),
    )
