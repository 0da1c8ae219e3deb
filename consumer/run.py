"""``relay consume``: the composition root of a consumer process.

The process opens what lives as long as it does, each on one ``AsyncExitStack``: settings
-> channel adapters -> pool -> health endpoints. Then it runs broker sessions
(``consumer/session.py``: connection, topology and publisher -> database watch -> consume
channel -> budgets -> store, gate, deliverer, worker -> consuming -> sampler and sweep,
each on the session's own exit stack) one after another, so every exit path of a session
or of the process closes what was opened, in reverse order, within a deadline.

One shutdown protocol for every cause: SIGTERM/SIGINT (exit 0); the broker connection, the
consume channel or the publisher channel closed, the consumer cancelled by the broker, a
publish not confirmed (the session ends and new ones are tried with backoff,
``consumer/reconnect.py``, in the same process; exit 3 past
``RELAY_BROKER_OUTAGE_MAX_SECONDS``), or the database unreachable past its bound (exit 3,
and the orchestrator restarts the pod). A session that fails while opening closes what it
had opened before the next one is tried. Stop intake -> give back claims that cannot
finish -> await requests already sent -> close. It always ends within the shutdown grace
period plus a few seconds, whatever the servers do. A broker alarm (the connection
blocked) pauses intake instead, and resumes it when the alarm clears.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
from collections.abc import Callable, Mapping

from opentelemetry import trace

from consumer import build, health, probes, reconnect
from consumer.channels.base import Channel
from consumer.session import CLOSE_STEP_SECONDS, Closing, Failure, Shared, run_session
from service import amqp, db, errors, signals
from service.settings import Settings
from service.telemetry import Metrics


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
            stop = stack.enter_context(signals.stopping_on_signals(asyncio.Event()))
        closing = Closing()
        adapters = dict(channels) if channels is not None else build.channels(settings)
        for adapter in adapters.values():
            stack.push_async_callback(closing.within, adapter.close)
        pool = await db.create_pool(settings)
        stack.push_async_callback(closing.within, lambda: db.close_pool(pool, closing.seconds()))
        health_probes = probes.Probes(settings)
        await _serve_health(stack, settings, health_probes, render_metrics, closing)
        shared = Shared(settings, pool, adapters, metrics, health_probes, tracer)
        failure: Failure | None = await run_session(shared, stop, closing, lambda: None)
        previous: reconnect.Outage | None = None
        while failure is not None and failure.outage is not None and not stop.is_set():
            closing.deadline = None
            failure.outage.follows(previous)
            previous = failure.outage
            failure = await reconnect.until_back(
                functools.partial(run_session, shared, stop, closing),
                failure.outage,
                stop,
                max_seconds=settings.broker_outage_max_seconds,
                random=rng,
            )
        return failure.exit_code if failure is not None else errors.ExitCode.OK
    raise AssertionError("unreachable")  # the exit stack never swallows an exception


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


async def check(settings: Settings) -> int:
    """``relay consume --check``: exit 0 if the database (with an up-to-date schema) and
    the broker answer. The settings were checked as ``relay consume`` checks them
    (``build.validate``); the health port is not, since the probe runs beside the consumer
    that holds it. A failure raises (one line, exit 2 or 3)."""
    pool = await db.create_pool(settings, size=1)  # also checks the schema
    try:
        await pool.fetchval(db.q("db_now"))
    finally:
        await db.close_pool(pool, CLOSE_STEP_SECONDS)
    connection = await amqp.connect(settings, name="relay-check")
    await amqp.close_connection(connection, CLOSE_STEP_SECONDS)
    print("ok: settings valid, database schema up to date, database and broker reachable")
    return errors.ExitCode.OK
