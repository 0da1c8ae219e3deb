"""Composition root of ``relay console``: settings, operators, pool, broker publisher,
sessions, metrics, the app.

The operators file is read before anything connects (a missing or bad one: exit 2). The
replay is ``publisher.replay.Replayer``'s, the one place beside the CLI's handlers where the
operator tools import ``publisher`` (this module is loaded only by ``relay console``). Every
exit path closes what it opened; SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiormq
import asyncpg
from aio_pika.abc import AbstractConnection
from aiohttp import web

from publisher import replay as publisher_replay
from service import (
    amqp,
    conventions,
    db,
    destination_switch,
    errors,
    logs,
    publishing,
    signals,
    telemetry,
)
from service.clock import Clock, SystemClock
from service.ledger import control, replays
from service.ops import destinations as ops_destinations
from service.ops.console import actions, app, operators, refs, security, sessions, throttle
from service.settings import Settings

log = logs.get("console")
_CLOSE_SECONDS = 5.0


def make_replay(
    pool: asyncpg.Pool,
    publisher: publishing.ConfirmedPublisher,
    connection: AbstractConnection,
    topology: amqp.Topology,
    metrics: telemetry.Metrics,
) -> actions.Replay:
    """The console's replay: ``publisher.replay``'s, one ``Replayer`` per request, one
    request at a time: an applied replay holds a pooled connection for its liveness lock
    (``service.ledger.replays.recorded``), and as many replays at once as the pool has
    connections would leave their own statements none."""
    one_at_a_time = asyncio.Lock()

    async def replay(
        source: str,
        filters: replays.ReplayFilter,
        limit: int,
        apply: bool,
        operator: str,
        reason: str,
    ) -> actions.ReplayResult:
        replayer = publisher_replay.Replayer(
            pool=pool, publisher=publisher, metrics=metrics, operator=operator, reason=reason
        )
        result: actions.ReplayResult
        async with one_at_a_time:
            if source == "ledger":
                result = await replayer.from_ledger(filters, limit=limit, apply=apply)
                return result
            channel = await connection.channel()
            try:
                result = await replayer.from_queue(topology, channel, limit=limit, apply=apply)
            finally:
                await channel.close()
            return result

    return replay


def make_queue_depth(
    connection: AbstractConnection, topology: amqp.Topology, timeout_seconds: float
) -> actions.QueueDepth:
    """How many dead letters the broker holds, asked on a channel of its own."""

    async def depth() -> int | None:
        try:
            async with asyncio.timeout(timeout_seconds):
                channel = await connection.channel()
                try:
                    queue = await channel.declare_queue(topology.dead_queue, passive=True)
                    return queue.declaration_result.message_count
                finally:
                    await channel.close()
        except (aiormq.exceptions.AMQPError, OSError, TimeoutError):
            return None

    return depth


def load_operators(settings: Settings) -> operators.Operators:
    """The operators file of the settings; ``ConfigError`` (exit 2) if it is missing or bad."""
    if settings.console_operators_file is None:
        raise errors.ConfigError(
            "RELAY_CONSOLE_OPERATORS_FILE: the console needs its operators file (a line per "
            f"operator); {operators.HOW}"
        )
    return operators.Operators(Path(settings.console_operators_file))


def session_policy(settings: Settings) -> sessions.Policy:
    return sessions.Policy(
        idle_seconds=settings.console_session_idle_minutes * 60,
        absolute_seconds=settings.console_session_max_hours * 3600,
        https=settings.console_https,
    )


@contextlib.asynccontextmanager
async def serving(
    settings: Settings, known: operators.Operators, clock: Clock | None = None
) -> AsyncIterator[tuple[web.AppRunner, int]]:
    """The console listening on RELAY_CONSOLE_HOST:PORT; yields the runner and its port."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry

    switch = switching(settings)  # a bad RELAY_ALLOW_NETWORKS stops it before connecting
    registry = CollectorRegistry(auto_describe=True)  # this console's own /metrics
    telem = telemetry.setup("relay-console", [PrometheusMetricReader(registry=registry)])
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(telem.shutdown)
        pool = await db.create_pool(settings, size=4)
        stack.push_async_callback(db.close_pool, pool, _CLOSE_SECONDS)
        key = await refs.load(pool)
        door = security.Door(
            known,
            sessions.Sessions(pool, clock or SystemClock(), session_policy(settings)),
            throttle.LoginThrottle(),
            telem.metrics.console_login_failures,
            open_reads=settings.console_open_reads,
            proxy_hops=settings.console_proxy_hops,
        )
        connection, publisher = await publishing.open_publisher(settings, "relay-console")
        stack.push_async_callback(amqp.close_connection, connection, _CLOSE_SECONDS)
        topology = amqp.Topology.from_settings(settings)
        replay = make_replay(pool, publisher, connection, topology, telem.metrics)
        depth = make_queue_depth(connection, topology, settings.amqp_timeout_seconds)
        wait = control.wire_wait_seconds(settings.http_timeout_seconds)
        built = app.build(
            pool,
            replay,
            depth,
            door,
            switch,
            key,
            lambda accept: conventions.render_prometheus(registry, accept),
            wire_wait_seconds=wait,
        )
        runner = web.AppRunner(built, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, settings.console_host, settings.console_port)
        try:
            await site.start()
        except OSError as exc:
            where = f"{settings.console_host}:{settings.console_port}"
            raise errors.ConfigError(
                f"RELAY_CONSOLE_PORT: cannot listen on {where} ({exc.strerror})"
            ) from None
        yield runner, _port(runner)


def switching(settings: Settings) -> actions.Switching:
    """What the destination switch needs, from the settings ``relay destinations`` reads."""
    return actions.Switching(
        allow=ops_destinations.allowed_networks(settings),
        missed=destination_switch.MissedFire.of(settings),
        clock=SystemClock(),
    )


def _port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        return int(address[1])
    raise AssertionError("a started site has an address")


async def main(args: argparse.Namespace, settings: Settings) -> int:
    """``relay console``: serve until SIGTERM or SIGINT."""
    known = load_operators(settings)
    async with contextlib.AsyncExitStack() as stack:  # one exit path, in reverse order
        _, port = await stack.enter_async_context(serving(settings, known))
        stop = stack.enter_context(signals.stopping_on_signals(asyncio.Event()))
        url = f"http://{settings.console_host}:{port}/"
        print(f"relay console: {url} (log in with your name and your token)", flush=True)
        log.info("console listening", extra={"event": "console_listening", "port": port})
        await stop.wait()
    return errors.ExitCode.OK
