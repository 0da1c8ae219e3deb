"""The console's event pages and their JSON: the latest events, and one event with every
delivery it fanned out to (one per subscribed destination: state, attempts, last answer).

Never the event's payload. An event's page shows each destination and last answer
redacted, as every other page does (``data.shown_row``, ``service.ops.redaction``), and
names the destination by its keyed reference; its Reveal button posts to the same address,
which records the reveal first (``pages.revealing``). The JSON API never reveals. Each
delivery links to its own page (attempts, replay).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from service import events
from service.ops.console import data, params
from service.ops.console.app_keys import POOL, REF_KEY
from service.ops.console.pages import render, revealing


async def _recent(request: web.Request) -> tuple[list[dict[str, Any]], int | None]:
    before = params.optional_int(request.query, "before")
    rows = await events.recent(request.app[POOL], data.PAGE, before)
    return rows, rows[-1]["id"] if len(rows) == data.PAGE else None


async def _one(request: web.Request, reveal: bool) -> dict[str, Any] | None:
    event_id = params.path_int(request, "event_id")
    return await data.event(request.app[POOL], request.app[REF_KEY], event_id, reveal=reveal)


async def events_page(request: web.Request) -> web.StreamResponse:
    rows, more = await _recent(request)
    return render(request, "events.html", "Events", events=rows, more=more)


async def event_page(request: web.Request, reveal: bool) -> web.StreamResponse:
    found = await _one(request, reveal)
    if found is None:
        raise web.HTTPNotFound(text=f"no event {request.match_info['event_id']}")
    return render(request, "event.html", f"Event {found['id']}", e=found, revealed=reveal)


async def events_api(request: web.Request) -> web.Response:
    rows, more = await _recent(request)
    return web.json_response(data.jsonable({"events": rows, "next_before": more}))


async def event_api(request: web.Request) -> web.Response:
    found = await _one(request, False)
    if found is None:
        return web.json_response(
            {"error": f"no event {request.match_info['event_id']}"}, status=404
        )
    return web.json_response(data.jsonable(found))


def routes() -> list[web.RouteDef]:
    event_get, event_reveal = revealing(event_page)
    return [
        web.get("/events", events_page),
        web.get("/events/{event_id}", event_get),
        web.post("/events/{event_id}", event_reveal),
        web.get("/api/v1/events", events_api),
        web.get("/api/v1/events/{event_id}", event_api),
    ]
