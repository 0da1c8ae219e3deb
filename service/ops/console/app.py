"""The console application: routes, templates, the security middleware, its dependencies.

``build`` takes everything it needs (the pool, the replay function, the door, the key of
destination references, the metrics to serve) so tests start it against real servers
exactly as ``relay console`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import asyncpg
import jinja2
from aiohttp import web

from service.ledger import control
from service.ops.console import actions, api, events, pages, refs, security
from service.ops.console.app_keys import ACTIONS, DOOR, POOL, REF_KEY, TEMPLATES

# Accept header -> the /metrics body and its Content-Type
MetricsRender = Callable[[str | None], tuple[bytes, str]]

HERE = Path(__file__).resolve().parent


def _when(at: datetime | None) -> str:
    return "—" if at is None else f"{at:%Y-%m-%d %H:%M:%S} UTC"


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f} s" if value < 120 else f"{value / 60:.1f} min"


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f} %"


def templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(when=_when, seconds=_seconds, percent=_percent)
    return env


def build(
    pool: asyncpg.Pool,
    replay: actions.Replay,
    queue_depth: actions.QueueDepth,
    door: security.Door,
    switching: actions.Switching,
    key: refs.RefKey,
    render_metrics: MetricsRender | None = None,
    *,
    wire_wait_seconds: float = control.wire_wait_seconds(10.0),
) -> web.Application:
    """The console's aiohttp application (``wire_wait_seconds``: how long a run's cancel
    or dead-letter waits for the requests it found on the wire)."""
    app = web.Application(middlewares=[security.middleware(door)], client_max_size=64 * 1024)
    app[POOL] = pool
    app[ACTIONS] = actions.Actions(pool, replay, queue_depth, switching, key, wire_wait_seconds)
    app[DOOR] = door
    app[TEMPLATES] = templates()
    app[REF_KEY] = key
    app.add_routes(pages.routes())
    app.add_routes(api.routes())
    app.add_routes(events.routes())
    app.add_routes([web.static("/static", HERE / "static")])
    if render_metrics is not None:
        app.add_routes([web.get("/metrics", _metrics(render_metrics))])
    return app


def _metrics(render: MetricsRender) -> pages.Handler:
    async def metrics(request: web.Request) -> web.Response:
        body, content_type = render(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    return metrics
