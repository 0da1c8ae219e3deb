"""Composition root of ``relay console``: settings, pool, broker publisher, the app.

The replay is ``publisher.replay.Replayer``, looked up by name when the console starts
(as the CLI looks up handlers), because the operator tools never import ``publisher``.
Every exit path closes what it opened; SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from aiohttp import web

from service import amqp, db, errors, ledger, logs, telemetry
from service.ops.console import actions, app, security
from service.settings import Settings

log = logs.get("console")
REPLAYER = "publisher.replay:Replayer"
_CLOSE_SECONDS = 5.0


def make_replay(
    pool: asyncpg.Pool, publisher: amqp.ConfirmedPublisher, metrics: telemetry.Metrics
) -> actions.Replay:
    """The console's replay: a ledger replay by ``publisher.replay``, one per request."""
    module, name = REPLAYER.split(":")
    replayer_class: Any = getattr(importlib.import_module(module), name)

    async def replay(
        filters: ledger.ReplayFilter, limit: int, apply: bool, operator: str, reason: str
    ) -> actions.ReplayResult:
        replayer = replayer_class(
            pool=pool, publisher=publisher, metrics=metrics, operator=operator, reason=reason
        )
        result: actions.ReplayResult = await replayer.from_ledger(filters, limit=limit, apply=apply)
        return result

    return replay


@contextlib.asynccontextmanager
async def serving(
    settings: Settings, door: security.Door
) -> AsyncIterator[tuple[web.AppRunner, int]]:
    """The console listening on RELAY_CONSOLE_HOST:PORT; yields the runner and its port."""
    async with contextlib.AsyncExitStack() as stack:
        pool = await db.create_pool(settings, size=4)
        stack.push_async_callback(db.close_pool, pool, _CLOSE_SECONDS)
        connection, publisher = await amqp.open_publisher(settings, "relay-console")
        stack.push_async_callback(amqp.close_connection, connection, _CLOSE_SECONDS)
        replay = make_replay(pool, publisher, telemetry.noop())
        runner = web.AppRunner(app.build(pool, replay, door), access_log=None)
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


def _port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        return int(address[1])
    raise AssertionError("a started site has an address")


async def main(args: argparse.Namespace, settings: Settings) -> int:
    """``relay console``: serve until SIGTERM or SIGINT."""
    door = security.Door(security.load_token(settings), open_reads=settings.console_open_reads)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    async with serving(settings, door) as (_, port):
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        url = f"http://{settings.console_host}:{port}/"
        print(f"relay console: {url} (log in with the operator token)", flush=True)
        log.info("console listening", extra={"event": "console_listening", "port": port})
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
    return errors.ExitCode.OK
