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
from collections.abc import Awaitable, Callable

from aiohttp import web

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
