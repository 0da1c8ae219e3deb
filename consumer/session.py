"""One broker session of a consumer process: open, consume until stopped or failed, shut
down, close.

Every resource a session opens is entered on the session's ``AsyncExitStack`` the moment
it is opened, so one exit path closes exactly what was opened, in reverse order, however
the session ends: a signal, a failure while consuming, or a failure while still opening
(a queue that refuses the consumer, a broker lost half way). In opening order: the task
that follows the process's stop, the broker connection and its confirmed publisher, the
database watch (its probe task), the consume channel and its grouped acks, the rate
budgets (their refill tasks), the ledger store (its batcher tasks), the worker (its
message tasks), the probes' view of the session, then, once consuming, the sampler and
the overdue sweep. A session whose opening failed leaves no task and no connection
behind while ``consumer/reconnect.py`` tries the next one
(``tests/fault/test_failed_session_starts.py``).

Shutdown, within the grace period: stop intake -> give back claims that cannot finish ->
await requests already sent -> close. A broker alarm (the connection blocked) pauses
intake instead, and resumes it when the alarm clears.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiormq
import asyncpg
from aio_pika.abc import AbstractChannel, AbstractConnection
from opentelemetry import trace

from consumer import build, incoming, probes, reconnect, sampler, worker
from consumer.acks import GroupedAcks
from consumer.channels.base import Channel
from consumer.outage import DatabaseWatch
from service import alarms, amqp, errors, logs, publishing
from service.settings import Settings
from service.telemetry import Metrics

log = logs.get("consumer")

# Each closing step gets at most this long, and all of them together end by the end of
# the grace period plus AFTER_GRACE_SECONDS.
CLOSE_STEP_SECONDS = 2.0
AFTER_GRACE_SECONDS = 3.0
DATABASE_GONE = "database unreachable"


class Failure:
    """Why a session must end (first cause wins); sets ``stop``. A broker failure of a
    session that consumed begins an ``Outage`` (new sessions follow), a database one is
    exit 3. A failure while the session is still opening is only that attempt's."""

    def __init__(self, stop: asyncio.Event) -> None:
        self._stop = stop
        self.reason: str | None = None
        self.closing = False  # our own close also closes channels: not a failure
        self.outage: reconnect.Outage | None = None
        self._live = False  # consuming began

    def fail(self, reason: str) -> None:
        if self.closing:
            return
        if self.reason is None:
            self.reason = reason
            if reason == DATABASE_GONE:
                log.error(
                    "stopping: server failure",
                    extra={"event": "server_failure", "reason": reason},
                )
            elif self._live:
                self.outage = reconnect.Outage(reason)
        self._stop.set()

    def consuming(self) -> None:
        """Consuming began: from now on a broker failure is an outage of this process."""
        self._live = True
        if self.reason is not None and self.reason != DATABASE_GONE and self.outage is None:
            self.outage = reconnect.Outage(self.reason)

    @property
    def exit_code(self) -> int:
        return errors.ExitCode.OK if self.reason is None else errors.ExitCode.UNAVAILABLE


class Closing:
    """The deadline every closing step shares once shutdown has begun."""

    def __init__(self) -> None:
        self.deadline: float | None = None  # monotonic; None until shutdown begins

    def seconds(self) -> float:
        """Time the next closing step may take."""
        if self.deadline is None:
            return CLOSE_STEP_SECONDS
        return max(0.05, min(CLOSE_STEP_SECONDS, self.deadline - time.monotonic()))

    async def within(self, step: Callable[[], Awaitable[Any]]) -> None:
        """Run one closing step; past its time it is abandoned (the process is ending)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.seconds() + 0.2):
                await step()


@dataclass(frozen=True)
class Shared:
    """What every broker session of one process shares (the process opened it)."""

    settings: Settings
    pool: asyncpg.Pool
    adapters: Mapping[str, Channel]
    metrics: Metrics
    probes: probes.Probes
    tracer: trace.Tracer | None


@dataclass(frozen=True)
class _Opened:
    """A session's parts, each already on its exit stack."""

    connection: AbstractConnection
    publisher: publishing.ConfirmedPublisher
    watch: DatabaseWatch
    consume_channel: AbstractChannel
    underlay: aiormq.abc.AbstractChannel
    work: worker.Worker
    consuming: asyncio.Event


async def run_session(
    shared: Shared, stop: asyncio.Event, closing: Closing, on_consuming: Callable[[], None]
) -> Failure:
    """One broker connection's life: open, consume until stopped or failed, shut down.
    Raises (``reconnect.OPEN_FAILED``) if it cannot be opened; whatever it opened until
    then is closed first."""
    halt = asyncio.Event()  # this session ends: stop asked, or a failure
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(_cancel_task, asyncio.create_task(_follow(stop, halt)))
        failure = Failure(halt)
        opened = await _open(stack, shared, failure, closing)
        tags = await _consume(stack, shared, opened, failure, on_consuming)
        await halt.wait()
        opened.consuming.clear()
        shared.metrics.snapshot.ready = False
        await _shutdown(shared.settings, opened, tags, failure, closing)
        return failure
    raise AssertionError("unreachable")  # the exit stack never swallows an exception


async def _open(
    stack: contextlib.AsyncExitStack, shared: Shared, failure: Failure, closing: Closing
) -> _Opened:
    """Everything up to consuming, each part on ``stack`` as soon as it is open."""
    settings, metrics = shared.settings, shared.metrics
    connection, publisher = await _open_broker(stack, settings, failure, closing)
    blocked = publisher.blocked  # an alarm is not a confirm timeout (open_publisher)
    assert blocked is not None
    watch = DatabaseWatch(
        shared.pool,
        outage_max_seconds=settings.database_outage_max_seconds,
        probe_timeout_seconds=settings.database_command_timeout_seconds,
        on_give_up=lambda: failure.fail(DATABASE_GONE),
    )
    stack.push_async_callback(watch.stop)
    consume_channel, underlay, acks = await _open_consume_channel(
        stack, connection, settings, failure, closing
    )
    budgets = build.budgets_for(settings, shared.pool)
    await budgets.setup()  # every replica writes the same configured budgets
    stack.push_async_callback(closing.within, budgets.close)
    stopping = asyncio.Event()
    ledger_store = build.store_for(settings, shared.pool, watch, stopping)
    ledger_store.start()
    stack.push_async_callback(closing.within, lambda: ledger_store.close(closing.seconds()))
    work = build.worker_for(
        settings,
        ledger_store,
        budgets,
        publisher,
        shared.adapters,
        metrics,
        shared.tracer,
        acks,
        stopping,
        on_broker_failure=lambda: failure.fail("publish not confirmed"),
    )
    # Cancels the message tasks left after the drain (or after a failed open).
    stack.push_async_callback(closing.within, lambda: work.close(closing.seconds()))
    consuming = asyncio.Event()
    blocked.listen(functools.partial(_alarm, work, blocked, metrics, consuming))
    session = probes.Session(connection, consume_channel, publisher, watch, work, consuming)
    shared.probes.attach(session)
    stack.callback(shared.probes.detach)
    return _Opened(connection, publisher, watch, consume_channel, underlay, work, consuming)


async def _consume(
    stack: contextlib.AsyncExitStack,
    shared: Shared,
    opened: _Opened,
    failure: Failure,
    on_consuming: Callable[[], None],
) -> list[str]:
    """Consume the lanes, then start the sampler and the sweep; the consumer tags."""
    settings, metrics = shared.settings, shared.metrics
    async with asyncio.timeout(settings.amqp_timeout_seconds):
        tags = [
            await incoming.consume(opened.underlay, queue, opened.work.accept)
            for queue in _lane_queues(settings)
        ]
    failure.consuming()
    opened.consuming.set()
    metrics.snapshot.ready = True
    on_consuming()
    topology = amqp.Topology.from_settings(settings)
    sampling = sampler.run_sampler(
        shared.pool, opened.connection, topology, metrics.snapshot, settings.metrics_sample_seconds
    )
    stack.push_async_callback(_cancel_task, asyncio.create_task(sampling))
    sweeping = build.overdue_sweep(
        settings,
        shared.pool,
        opened.connection,
        opened.publisher,
        metrics,
        on_unclaimed=lambda: failure.fail("lanes not delivering to this session"),
    )
    if sweeping is not None:
        stack.push_async_callback(_cancel_task, asyncio.create_task(sweeping))
    log.info("consuming", extra={"event": "consume_started", "prefetch": settings.prefetch})
    return tags


def _alarm(
    work: worker.Worker,
    blocked: alarms.Blocked,
    metrics: Metrics,
    consuming: asyncio.Event,
    is_blocked: bool,
    reason: str,
) -> None:
    """The broker blocked this connection (a memory or disk alarm) or unblocked it:
    intake pauses, then resumes; claimed work goes on, its publishes wait the alarm out.
    Not a session failure: a new connection would be blocked the same way."""
    metrics.snapshot.ready = consuming.is_set() and not is_blocked
    if is_blocked:
        work.pause()
        log.warning(
            "broker alarm: connection blocked; intake paused",
            extra={"event": "broker_blocked", "reason": reason, "in_flight": work.in_flight},
        )
    else:
        work.resume()
        log.info(
            "broker alarm cleared; intake resumed",
            extra={"event": "broker_unblocked", "blocked_seconds": round(blocked.seconds(), 3)},
        )


async def _follow(stop: asyncio.Event, halt: asyncio.Event) -> None:
    await stop.wait()
    halt.set()


async def _cancel_task(task: asyncio.Task[Any]) -> None:
    # A cancel that lands inside a library call can come out as that library's error (seen:
    # the metrics sampler logged a failed round and slept on, and the stop waited 60 s):
    # cancel again until the task has ended.
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    await asyncio.gather(task, return_exceptions=True)


async def _open_broker(
    stack: contextlib.AsyncExitStack, settings: Settings, failure: Failure, closing: Closing
) -> tuple[AbstractConnection, publishing.ConfirmedPublisher]:
    """Connect, declare the topology, open the publisher; their loss is a failure."""
    # announce_alarms=False: _alarm logs each block itself, and pauses intake.
    connection, publisher = await publishing.open_publisher(
        settings, "relay-consume", announce_alarms=False
    )
    stack.push_async_callback(
        closing.within, lambda: amqp.close_connection(connection, closing.seconds())
    )
    # On broker trouble the session ends (unacked messages go back to the other replicas)
    # and run() opens a new one on a fresh connection, to whichever node answers.
    connection.close_callbacks.add(lambda *_: failure.fail("broker connection lost"))
    publisher.channel.close_callbacks.add(lambda *_: failure.fail("publisher channel closed"))
    stack.callback(setattr, failure, "closing", True)  # runs before the close above
    return connection, publisher


async def _open_consume_channel(
    stack: contextlib.AsyncExitStack,
    connection: AbstractConnection,
    settings: Settings,
    failure: Failure,
    closing: Closing,
) -> tuple[AbstractChannel, aiormq.abc.AbstractChannel, GroupedAcks]:
    """The channel deliveries arrive on (and its aiormq underlay, which consumes) and the
    channel's grouped acks. Its closing, or the broker cancelling our consumer (a deleted
    queue), is a failure; closing it ourselves is not."""
    async with asyncio.timeout(settings.amqp_timeout_seconds):
        channel = await connection.channel()

        def lost(*_: object) -> None:
            failure.fail("consume channel closed")

        async def close() -> None:
            channel.close_callbacks.discard(lost)
            await channel.close()

        channel.close_callbacks.add(lost)
        stack.push_async_callback(closing.within, close)
        await channel.set_qos(prefetch_count=settings.prefetch)
        underlay = await channel.get_underlay_channel()
    underlay.on_consumer_cancel_callbacks.add(
        lambda *_: failure.fail("consumer cancelled by the broker")
    )

    async def ack(tag: int, multiple: bool) -> None:
        await underlay.basic_ack(tag, multiple=multiple)

    acks = GroupedAcks(ack)
    stack.push_async_callback(closing.within, acks.close)  # acks settled go out first
    return channel, underlay, acks


def _lane_queues(settings: Settings) -> list[str]:
    """The lanes' queues, urgent first, so a bulk backlog never sits in front of it."""
    topology = amqp.Topology.from_settings(settings)
    return [topology.lane_queue(lane) for lane in (amqp.URGENT, amqp.BULK)]


async def _shutdown(
    settings: Settings, opened: _Opened, tags: list[str], failure: Failure, closing: Closing
) -> None:
    """Stop intake, give back what cannot finish, await what was sent; all within grace."""
    work = opened.work
    started = time.monotonic()
    grace_end = started + settings.shutdown_grace_seconds
    closing.deadline = grace_end + AFTER_GRACE_SECONDS
    work.stop_intake(grace_ends_at=grace_end)
    drain_end, last_end = grace_end - 1.0, grace_end
    if failure.reason is not None:
        work.give_back_now()  # a server failed: waiting for budget or slots is pointless
    if failure.outage is not None:
        # Only requests already on the wire are awaited (their outcome written): each
        # ends within its timeout. Then the next session may begin.
        drain_end = min(drain_end, started + settings.http_timeout_seconds + CLOSE_STEP_SECONDS)
        last_end = drain_end + 1.0
    if not opened.consume_channel.is_closed:
        for tag in tags:
            await closing.within(functools.partial(opened.underlay.basic_cancel, tag))
    # Requests on the wire finish (HTTP timeout < grace); claims that could not start
    # are released and handed back before the end of grace.
    drained = await work.drain(drain_end)
    opened.watch.close()  # statements still waiting out an outage give up: their work goes back
    drained = await work.drain(last_end) or drained
    log.info(
        "consumer stopping",
        extra={
            "event": "consume_stopping",
            "drained": drained,
            "left": work.in_flight,
            "left_to_broker": work.left_to_broker,
            "reason": failure.reason or "signal",
        },
    )
