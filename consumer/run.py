"""``relay consume``: the composition root of a consumer process.

Builds settings -> channels -> pool -> health endpoints, then broker sessions: broker
connection, topology and publisher -> database watch -> budgets -> store, gate,
deliverer, worker -> consume channel -> sampler, each registered on one
``AsyncExitStack`` so every exit path closes what was opened, in reverse order, within a
deadline.

One shutdown protocol for every cause: SIGTERM/SIGINT (exit 0); the broker connection, the
consume channel or the publisher channel closed, the consumer cancelled by the broker, a
publish not confirmed (the session ends and new ones are tried with backoff,
``consumer/reconnect.py``, in the same process; exit 3 past
``RELAY_BROKER_OUTAGE_MAX_SECONDS``), or the database unreachable past its bound (exit 3,
and the orchestrator restarts the pod). Stop intake -> give back claims that cannot
finish -> await requests already sent -> close. It always ends within the shutdown grace
period plus a few seconds, whatever the servers do. A broker alarm (the connection
blocked) pauses intake instead, and resumes it when the alarm clears.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiormq
import asyncpg
from aio_pika.abc import AbstractChannel, AbstractConnection
from opentelemetry import trace

from consumer import build, health, incoming, probes, reconnect, sampler, worker
from consumer.acks import GroupedAcks
from consumer.channels.base import Channel
from consumer.outage import DatabaseWatch
from service import alarms, amqp, db, errors, logs
from service.settings import Settings
from service.telemetry import Metrics

log = logs.get("consumer")

# Each closing step gets at most this long, and all of them together end by the end of
# the grace period plus _AFTER_GRACE_SECONDS.
_CLOSE_STEP_SECONDS = 2.0
_AFTER_GRACE_SECONDS = 3.0
_DATABASE_GONE = "database unreachable"


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
            if reason == _DATABASE_GONE:
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
        if self.reason is not None and self.reason != _DATABASE_GONE and self.outage is None:
            self.outage = reconnect.Outage(self.reason)

    @property
    def exit_code(self) -> int:
        return errors.ExitCode.OK if self.reason is None else errors.ExitCode.UNAVAILABLE


@contextlib.contextmanager
def _signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGTERM/SIGINT set ``stop``; the previous handlers come back on exit."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


class Closing:
    """The deadline every closing step shares once shutdown has begun."""

    def __init__(self) -> None:
        self.deadline: float | None = None  # monotonic; None until shutdown begins

    def seconds(self) -> float:
        """Time the next closing step may take."""
        if self.deadline is None:
            return _CLOSE_STEP_SECONDS
        return max(0.05, min(_CLOSE_STEP_SECONDS, self.deadline - time.monotonic()))

    async def within(self, step: Callable[[], Awaitable[Any]]) -> None:
        """Run one closing step; past its time it is abandoned (the process is ending)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.seconds() + 0.2):
                await step()


async def _cancel_task(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@dataclass(frozen=True)
class _Parts:
    """What every broker session of one process shares."""

    settings: Settings
    pool: asyncpg.Pool
    adapters: Mapping[str, Channel]
    metrics: Metrics
    probes: probes.Probes
    tracer: trace.Tracer | None


async def run(
    settings: Settings,
    *,
    metrics: Metrics,
    render_metrics: health.MetricsRender | None = None,
    channels: Mapping[str, Channel] | None = None,
    stop: asyncio.Event | None = None,
    tracer: trace.Tracer | None = None,
    rng: Callable[[], float] = random.random,
) -> int:
    """Consume until SIGTERM/SIGINT (or until ``stop`` is set); return the exit code.

    Losing the broker (a node gone, a channel closed) ends one session: its work in
    flight finishes and is recorded, and new sessions are tried with jittered backoff
    (``rng``) in the same process, keeping the pool, the adapters and the health
    endpoint. The process ends with exit 3 only when the broker stays unusable past
    ``RELAY_BROKER_OUTAGE_MAX_SECONDS``, or the database past its own bound.
    """
    async with contextlib.AsyncExitStack() as stack:
        if stop is None:
            stop = asyncio.Event()
            stack.enter_context(_signals(stop))
        closing = Closing()
        adapters = dict(channels) if channels is not None else build.channels(settings)
        for adapter in adapters.values():
            stack.push_async_callback(closing.within, adapter.close)
        pool = await db.create_pool(settings)
        stack.push_async_callback(closing.within, lambda: db.close_pool(pool, closing.seconds()))
        health_probes = probes.Probes(settings)
        await _serve_health(stack, settings, health_probes, render_metrics, closing)
        parts = _Parts(settings, pool, adapters, metrics, health_probes, tracer)
        failure: Failure | None = await _session(parts, stop, closing, lambda: None)
        previous: reconnect.Outage | None = None
        while failure is not None and failure.outage is not None and not stop.is_set():
            closing.deadline = None
            failure.outage.follows(previous)
            previous = failure.outage
            failure = await reconnect.until_back(
                functools.partial(_session, parts, stop, closing),
                failure.outage,
                stop,
                max_seconds=settings.broker_outage_max_seconds,
                random=rng,
            )
        return failure.exit_code if failure is not None else errors.ExitCode.OK
    raise AssertionError("unreachable")  # the exit stack never swallows an exception


async def _session(
    parts: _Parts, stop: asyncio.Event, closing: Closing, on_consuming: Callable[[], None]
) -> Failure:
    """One broker connection's life: open, consume until stopped or failed, shut down.
    Raises (``reconnect.OPEN_FAILED``) if it cannot be opened; nothing was taken then."""
    settings, metrics = parts.settings, parts.metrics
    halt = asyncio.Event()  # this session ends: stop asked, or a failure
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(_cancel_task, asyncio.create_task(_follow(stop, halt)))
        failure = Failure(halt)
        connection, publisher = await _open_broker(stack, settings, failure, closing)
        blocked = alarms.watch(connection)
        publisher.blocked = blocked  # an alarm is not a confirm timeout
        watch = DatabaseWatch(
            parts.pool,
            outage_max_seconds=settings.database_outage_max_seconds,
            probe_timeout_seconds=settings.database_command_timeout_seconds,
            on_give_up=lambda: failure.fail(_DATABASE_GONE),
        )
        stack.push_async_callback(watch.stop)
        consume_channel, underlay, acks = await _open_consume_channel(connection, settings, failure)
        work = await build.worker_for(
            settings, parts.pool, watch, publisher, parts.adapters, metrics, parts.tracer, acks,
            on_broker_failure=lambda: failure.fail("publish not confirmed"),
        )  # fmt: skip
        # Cancels what is left after the drain (or after a failed open), stops the writers.
        stack.push_async_callback(closing.within, lambda: work.close(closing.seconds()))
        consuming = asyncio.Event()
        blocked.listen(functools.partial(_alarm, work, blocked, metrics, consuming))
        parts.probes.attach(
            probes.Session(connection, consume_channel, publisher, watch, work, consuming)
        )
        stack.callback(parts.probes.detach)
        async with asyncio.timeout(settings.amqp_timeout_seconds):
            tags = [
                await incoming.consume(underlay, queue, work.accept)
                for queue in _lane_queues(settings)
            ]
        failure.consuming()
        consuming.set()
        metrics.snapshot.ready = True
        on_consuming()
        sampling = sampler.run_sampler(
            parts.pool,
            connection,
            amqp.Topology.from_settings(settings),
            metrics.snapshot,
            settings.metrics_sample_seconds,
        )
        stack.push_async_callback(_cancel_task, asyncio.create_task(sampling))
        sweeping = build.overdue_sweep(settings, parts.pool, connection, publisher, metrics)
        if sweeping is not None:
            stack.push_async_callback(_cancel_task, asyncio.create_task(sweeping))
        log.info("consuming", extra={"event": "consume_started", "prefetch": settings.prefetch})

        await halt.wait()
        consuming.clear()
        metrics.snapshot.ready = False
        await _shutdown(settings, work, watch, consume_channel, underlay, tags, failure, closing)
        return failure
    raise AssertionError("unreachable")  # the exit stack never swallows an exception


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


async def _serve_health(
    stack: contextlib.AsyncExitStack,
    settings: Settings,
    health_probes: probes.Probes,
    render_metrics: health.MetricsRender | None,
    closing: Closing,
) -> None:
    if settings.health_port:
        try:
            runner = await health.serve(
                health.build_app(health_probes.ready, health_probes.live, render_metrics),
                settings.health_host,
                settings.health_port,
            )
        except OSError as exc:  # taken since check_health_port looked: the same one line
            raise health.port_error(settings, exc) from None
        stack.push_async_callback(closing.within, runner.cleanup)


async def _open_broker(
    stack: contextlib.AsyncExitStack, settings: Settings, failure: Failure, closing: Closing
) -> tuple[AbstractConnection, amqp.ConfirmedPublisher]:
    """Connect, declare the topology, open the publisher; their loss is a failure."""
    connection, publisher = await amqp.open_publisher(settings, "relay-consume")
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
    connection: AbstractConnection, settings: Settings, failure: Failure
) -> tuple[AbstractChannel, aiormq.abc.AbstractChannel, GroupedAcks]:
    """The channel deliveries arrive on (and its aiormq underlay, which consumes) and the
    channel's grouped acks. Its closing, or the broker cancelling our consumer (a deleted
    queue), is a failure."""
    async with asyncio.timeout(settings.amqp_timeout_seconds):
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=settings.prefetch)
        underlay = await channel.get_underlay_channel()
    channel.close_callbacks.add(lambda *_: failure.fail("consume channel closed"))
    underlay.on_consumer_cancel_callbacks.add(
        lambda *_: failure.fail("consumer cancelled by the broker")
    )

    async def ack(tag: int, multiple: bool) -> None:
        await underlay.basic_ack(tag, multiple=multiple)

    return channel, underlay, GroupedAcks(ack)


def _lane_queues(settings: Settings) -> list[str]:
    """The lanes' queues, urgent first, so a bulk backlog never sits in front of it."""
    topology = amqp.Topology.from_settings(settings)
    return [topology.lane_queue(lane) for lane in (amqp.URGENT, amqp.BULK)]


async def _shutdown(
    settings: Settings,
    work: worker.Worker,
    watch: DatabaseWatch,
    consume_channel: AbstractChannel,
    underlay: aiormq.abc.AbstractChannel,
    tags: list[str],
    failure: Failure,
    closing: Closing,
) -> None:
    """Stop intake, give back what cannot finish, await what was sent; all within grace."""
    started = time.monotonic()
    grace_end = started + settings.shutdown_grace_seconds
    closing.deadline = grace_end + _AFTER_GRACE_SECONDS
    work.stop_intake(grace_ends_at=grace_end)
    drain_end, last_end = grace_end - 1.0, grace_end
    if failure.reason is not None:
        work.give_back_now()  # a server failed: waiting for budget or slots is pointless
    if failure.outage is not None:
        # Only requests already on the wire are awaited (their outcome written): each
        # ends within its timeout. Then the next session may begin.
        drain_end = min(drain_end, started + settings.http_timeout_seconds + _CLOSE_STEP_SECONDS)
        last_end = drain_end + 1.0
    if not consume_channel.is_closed:
        for tag in tags:
            await closing.within(functools.partial(underlay.basic_cancel, tag))
    # Requests on the wire finish (HTTP timeout < grace); claims that could not start
    # are released and handed back before the end of grace.
    drained = await work.drain(drain_end)
    watch.close()  # statements still waiting out an outage give up: their work goes back
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


async def check(settings: Settings) -> int:
    """``relay consume --check``: exit 0 if the database (with an up-to-date schema) and
    the broker answer. The settings were checked as ``relay consume`` checks them
    (``build.validate``); the health port is not, since the probe runs beside the consumer
    that holds it. A failure raises (one line, exit 2 or 3)."""
    pool = await db.create_pool(settings, size=1)  # also checks the schema
    try:
        await pool.fetchval(db.q("db_now"))
    finally:
        await db.close_pool(pool, _CLOSE_STEP_SECONDS)
    connection = await amqp.connect(settings, name="relay-check")
    await amqp.close_connection(connection, _CLOSE_STEP_SECONDS)
    print("ok: settings valid, database schema up to date, database and broker reachable")
    return errors.ExitCode.OK
