"""``relay consume``: the composition root of a consumer process.

Builds settings -> channels -> pool -> broker connection, topology and publisher ->
database watch -> budgets -> store, gate, deliverer, worker -> consume channel -> health
endpoints -> sampler, each registered on one ``AsyncExitStack`` so every exit path closes
what was opened, in reverse order, within a deadline.

One shutdown protocol for every cause: SIGTERM/SIGINT (exit 0); the broker connection, the
consume channel or the publisher channel closed, the consumer cancelled by the broker, a
publish not confirmed (the session ends and a new one connects to the broker's nodes in
turn, in the same process; exit 3 if none can be used), or the database unreachable past
its bound (exit 3, and the orchestrator restarts the pod). Stop intake -> give back claims
that cannot finish -> await requests already sent -> close. It always ends within the
shutdown grace period plus a few seconds, whatever the servers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiormq
import asyncpg
from aio_pika.abc import AbstractChannel, AbstractConnection
from opentelemetry import trace

from consumer import build, health, incoming, sampler, worker
from consumer.acks import GroupedAcks
from consumer.channels.base import Channel
from consumer.outage import DatabaseWatch
from service import amqp, brokers, db, errors, logs
from service.settings import Settings
from service.telemetry import Metrics

log = logs.get("consumer")

# Each closing step gets at most this long, and all of them together end by the end of
# the grace period plus _AFTER_GRACE_SECONDS.
_CLOSE_STEP_SECONDS = 2.0
_AFTER_GRACE_SECONDS = 3.0
# Pauses before each attempt to connect again after the broker was lost (s).
_RECONNECT_PAUSES = (0.5, 1.0, 2.0, 4.0)
_DATABASE_GONE = "database unreachable"
_OPEN_FAILED: tuple[type[BaseException], ...] = (errors.UnavailableError, *brokers.NODE_ERRORS)


class Failure:
    """Why a session must end (first cause wins); sets ``stop``. A broker failure is
    followed by a new session, a database one by exit 3."""

    def __init__(self, stop: asyncio.Event) -> None:
        self._stop = stop
        self.reason: str | None = None
        self.closing = False  # our own close also closes channels: not a failure

    def fail(self, reason: str) -> None:
        if self.closing:
            return
        if self.reason is None:
            self.reason = reason
            log.error(
                "stopping: server failure", extra={"event": "server_failure", "reason": reason}
            )
        self._stop.set()

    @property
    def reconnect(self) -> bool:
        """The broker failed, not the database: a new connection may cure it."""
        return self.reason is not None and self.reason != _DATABASE_GONE

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
    render_metrics: health.MetricsRender | None
    tracer: trace.Tracer | None


async def run(
    settings: Settings,
    *,
    metrics: Metrics,
    render_metrics: health.MetricsRender | None = None,
    channels: Mapping[str, Channel] | None = None,
    stop: asyncio.Event | None = None,
    tracer: trace.Tracer | None = None,
) -> int:
    """Consume until SIGTERM/SIGINT (or until ``stop`` is set); return the exit code.

    Losing the broker (a cluster node gone, a channel closed) ends one session: its
    messages go back as on any failure, and a new session connects to the nodes in turn
    in the same process, keeping the pool and the adapters. The process ends with exit 3
    only when no node can be used, or the database is unreachable past its bound.
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
        parts = _Parts(settings, pool, adapters, metrics, render_metrics, tracer)
        failure = await _session(parts, stop, closing)
        while failure.reconnect and not stop.is_set():
            closing.deadline = None
            failure = await _reconnect(parts, stop, closing, failure)
        return failure.exit_code
    raise AssertionError("unreachable")  # the exit stack never swallows an exception


async def _reconnect(
    parts: _Parts, stop: asyncio.Event, closing: Closing, lost: Failure
) -> Failure:
    """A new session after the broker was lost; a few rounds over the nodes (a cluster
    elects new queue leaders within seconds) before giving up with the last error."""
    log.warning(
        "broker lost; reconnecting",
        extra={"event": "broker_reconnect", "reason": lost.reason},
    )
    for attempt, pause in enumerate(_RECONNECT_PAUSES, 1):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), pause)
        if stop.is_set():
            return Failure(stop)  # asked to stop meanwhile: a clean exit
        try:
            return await _session(parts, stop, closing)
        except _OPEN_FAILED as exc:  # no node, or one still electing its queue leaders
            if attempt == len(_RECONNECT_PAUSES):
                if isinstance(exc, errors.UnavailableError):
                    raise
                raise errors.UnavailableError(f"broker unusable: {type(exc).__name__}") from exc
    raise AssertionError("unreachable")


async def _session(parts: _Parts, stop: asyncio.Event, closing: Closing) -> Failure:
    """One broker connection's life: open, consume until stopped or failed, shut down."""
    settings, metrics = parts.settings, parts.metrics
    halt = asyncio.Event()  # this session ends: stop asked, or a failure
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(_cancel_task, asyncio.create_task(_follow(stop, halt)))
        failure = Failure(halt)
        connection, publisher = await _open_broker(stack, settings, failure, closing)
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
        consuming = asyncio.Event()
        probes = _Probes(settings, connection, consume_channel, publisher, watch, work, consuming)
        await _serve_health(stack, settings, probes, parts.render_metrics, closing)
        async with asyncio.timeout(settings.amqp_timeout_seconds):
            tags = [
                await incoming.consume(underlay, queue, work.on_message)
                for queue in _lane_queues(settings)
            ]
        consuming.set()
        metrics.snapshot.ready = True
        sampling = sampler.run_sampler(
            parts.pool,
            connection,
            amqp.Topology.from_settings(settings),
            metrics.snapshot,
            settings.metrics_sample_seconds,
        )
        stack.push_async_callback(_cancel_task, asyncio.create_task(sampling))
        log.info("consuming", extra={"event": "consume_started", "prefetch": settings.prefetch})

        await halt.wait()
        consuming.clear()
        metrics.snapshot.ready = False
        await _shutdown(settings, work, watch, consume_channel, underlay, tags, failure, closing)
        return failure
    raise AssertionError("unreachable")  # the exit stack never swallows an exception


async def _follow(stop: asyncio.Event, halt: asyncio.Event) -> None:
    await stop.wait()
    halt.set()


async def _serve_health(
    stack: contextlib.AsyncExitStack,
    settings: Settings,
    probes: _Probes,
    render_metrics: health.MetricsRender | None,
    closing: Closing,
) -> None:
    if settings.health_port:
        try:
            runner = await health.serve(
                health.build_app(probes.ready, probes.live, render_metrics),
                settings.health_host,
                settings.health_port,
            )
        except OSError as exc:  # taken since check_health_port looked: the same one line
            raise health.port_error(settings, exc) from None
        stack.push_async_callback(closing.within, runner.cleanup)


@dataclass(frozen=True)
class _Probes:
    """Readiness and liveness of this process, for the health endpoints."""

    settings: Settings
    connection: AbstractConnection
    consume_channel: AbstractChannel
    publisher: amqp.ConfirmedPublisher
    watch: DatabaseWatch
    work: worker.Worker
    consuming: asyncio.Event

    async def ready(self) -> tuple[bool, dict[str, bool]]:
        """Every channel open, the database answering, and consuming."""
        broker_ok = not (
            self.connection.is_closed or self.consume_channel.is_closed or self.publisher.closed
        )
        db_ok = await self.watch.check()
        consuming = self.consuming.is_set()
        ok = broker_ok and db_ok and consuming
        return ok, {"broker": broker_ok, "database": db_ok, "consuming": consuming}

    def live(self) -> tuple[bool, dict[str, float]]:
        """Progress is possible: no outage past its bound, held messages keep finishing."""
        outage, stalled = self.watch.outage_seconds, self.work.stalled_for()
        ok = outage <= self.settings.database_outage_max_seconds
        ok = ok and stalled <= self.settings.liveness_stall_seconds
        return ok, {
            "database_outage_seconds": round(outage, 3),
            "stalled_seconds": round(stalled, 3),
        }


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
    if failure.reason is not None:
        work.give_back_now()  # a server failed: waiting for budget or slots is pointless
    if not consume_channel.is_closed:
        for tag in tags:
            await closing.within(functools.partial(underlay.basic_cancel, tag))
    # Requests on the wire finish (HTTP timeout < grace); claims that could not start
    # are released and handed back before the end of grace.
    drained = await work.drain(grace_end - 1.0)
    watch.close()  # statements still waiting out an outage give up: their work goes back
    drained = await work.drain(grace_end) or drained
    log.info(
        "consumer stopping",
        extra={
            "event": "consume_stopping",
            "drained": drained,
            "left": work.in_flight,
            "reason": failure.reason or "signal",
        },
    )
    await work.close(closing.seconds())


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
