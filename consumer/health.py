"""Liveness, readiness and the Prometheus scrape endpoint of a consumer process.

``/livez`` answers 200 while the process can still make progress: the event loop runs,
the database has not been unreachable past its bound, and held messages keep finishing.
``/readyz`` answers 200 only while the broker connection and every channel the process
needs are open, the database answers, and the process is consuming.
``/metrics`` renders the OpenTelemetry Prometheus reader's registry in the format the
scraper's ``Accept`` header asks for (``prometheus_client``'s content negotiation).
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Awaitable, Callable

from aiohttp import web

from service import errors
from service.settings import Settings

ReadyCheck = Callable[[], Awaitable[tuple[bool, dict[str, bool]]]]
LiveCheck = Callable[[], tuple[bool, dict[str, float]]]
# The scraper's Accept header -> the body and its Content-Type.
MetricsRender = Callable[[str | None], tuple[bytes, str]]


def build_app(
    ready: ReadyCheck, live: LiveCheck, render_metrics: MetricsRender | None
) -> web.Application:
    async def livez(_: web.Request) -> web.Response:
        ok, parts = live()
        return web.json_response(
            {"status": "alive" if ok else "stuck", **parts}, status=200 if ok else 503
        )

    async def readyz(_: web.Request) -> web.Response:
        try:
            ok, parts = await asyncio.wait_for(ready(), timeout=2.0)
        except (TimeoutError, OSError):
            ok, parts = False, {"timeout": True}
        return web.json_response(
            {"status": "ready" if ok else "not ready", **parts}, status=200 if ok else 503
        )

    async def metrics(request: web.Request) -> web.Response:
        assert render_metrics is not None
        body, content_type = render_metrics(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    if render_metrics is not None:
        app.router.add_get("/metrics", metrics)
    return app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Start the server; the caller cleans the runner up on shutdown."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def check_health_port(settings: Settings) -> None:
    """Raise ConfigError naming RELAY_HEALTH_PORT (or RELAY_HEALTH_HOST) unless the health
    endpoint's address can be bound now: called before any server is opened, so a second
    ``relay consume`` on one host fails at once, in one line."""
    if not settings.health_port:
        return
    try:
        infos = socket.getaddrinfo(
            settings.health_host,
            settings.health_port,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )
        for family, kind, proto, _, address in infos:
            with socket.socket(family, kind, proto) as probe:
                # As the server binds (SO_REUSEADDR): only a listening socket conflicts.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
    except OSError as exc:
        raise port_error(settings, exc) from None


def port_error(settings: Settings, exc: OSError) -> errors.ConfigError:
    where = f"{settings.health_host}:{settings.health_port}"
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return errors.ConfigError(
            f"RELAY_HEALTH_HOST: cannot listen on {where}: not an address of this host"
        )
    if exc.errno == errno.EADDRINUSE:
        reason = "already in use (another relay consume on this host?)"
    elif exc.errno == errno.EACCES:
        reason = "not permitted (ports below 1024 need privileges)"
    else:
        reason = (exc.strerror or type(exc).__name__).lower()
    return errors.ConfigError(
        f"RELAY_HEALTH_PORT: cannot listen on {where}: {reason}; choose another port, "
        "or 0 to turn the health endpoint off"
    )
