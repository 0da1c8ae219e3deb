"""The JSON API under ``/api/v1`` (docs/console.md): the pages' data, as JSON.

Reads share ``data`` with the pages; actions share ``actions``. A state-changing call
needs an operator's token (``Authorization: Bearer`` with ``X-Relay-Operator``) or a
session with its CSRF token. Recipients and replies are always redacted here (as the
CLI's output is): revealing them is a recorded action on a page, for a person.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from service.ops.console import actions, data, params
from service.ops.console.app_keys import ACTIONS, POOL, REF_KEY, operator_name


def _json(value: Any, status: int = 200) -> web.Response:
    return web.json_response(data.jsonable(value), status=status)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise params.bad("body", "a JSON object") from None
    if not isinstance(body, dict):
        raise params.bad("body", "a JSON object")
    return body


async def runs(request: web.Request) -> web.Response:
    limit = min(params.optional_int(request.query, "limit") or 50, 500)
    return _json({"runs": await data.run_list(request.app[POOL], limit)})


async def run_missing(request: web.Request) -> web.Response:
    run_id = params.path_int(request, "run_id")
    run = await data.run_one(request.app[POOL], run_id)
    if run is None:
        return _json({"error": f"no run {run_id}"}, 404)
    selection = params.missing_filter(request.query)
    limit = min(params.optional_int(request.query, "limit") or data.PAGE, 1000)
    rows = await data.run_missing(request.app[POOL], request.app[REF_KEY], run_id, selection, limit)
    run["actions"] = await data.run_actions(request.app[POOL], run_id)
    return _json({"run": run, "missing": rows, "next_after": rows[-1]["id"] if rows else None})


async def delivery(request: web.Request) -> web.Response:
    delivery_id = params.path_int(request, "delivery_id")
    found = await data.delivery(request.app[POOL], request.app[REF_KEY], delivery_id)
    if found is None:
        return _json({"error": f"no delivery {delivery_id}"}, 404)
    return _json(found)


async def dead(request: web.Request) -> web.Response:
    found = await data.dead(
        request.app[POOL],
        params.optional_int(request.query, "run"),
        params.choice(request.query, "channel", data.CHANNELS),
        params.optional_int(request.query, "before"),
    )
    found["queue_depth"] = await request.app[ACTIONS].queue_depth()
    return _json(found)


async def replay(request: web.Request) -> web.Response:
    body = await _body(request)
    wanted = params.replay_request(body)
    try:
        summary = await request.app[ACTIONS].replay_dead(
            operator_name(request),
            wanted,
            apply=body.get("apply") is True,
            reason=str(body.get("reason", "")),
        )
    except actions.ActionError as exc:
        return _json({"error": str(exc)}, 400)
    return _json(summary)


async def run_action(request: web.Request) -> web.Response:
    body = await _body(request)
    try:
        result = await request.app[ACTIONS].run_action(
            operator_name(request),
            params.path_int(request, "run_id"),
            request.match_info["action"],
            apply=body.get("apply") is True,
            reason=str(body.get("reason", "")),
        )
    except actions.ActionError as exc:
        return _json({"error": str(exc)}, 400)
    return _json(result)


async def destinations(request: web.Request) -> web.Response:
    found = await data.destinations(request.app[POOL], request.app[REF_KEY])
    return _json({"destinations": found})


async def switch_destination(request: web.Request) -> web.Response:
    body = await _body(request)
    ref = params.ref(request.match_info["ref"])
    assert ref is not None  # the route's pattern requires it
    try:
        result = await request.app[ACTIONS].switch_destination(
            operator_name(request),
            ref,
            enable=request.match_info["action"] == "enable",
            apply=body.get("apply") is True,
            reason=str(body.get("reason", "")),
        )
    except actions.ActionError as exc:
        return _json({"error": str(exc)}, 400)
    return _json(result)


def routes() -> list[web.RouteDef]:
    return [
        web.get("/api/v1/runs", runs),
        web.get("/api/v1/runs/{run_id}/missing", run_missing),
        web.post("/api/v1/runs/{run_id}/{action:hold|release|cancel|dead-letter}", run_action),
        web.get("/api/v1/deliveries/{delivery_id}", delivery),
        web.get("/api/v1/dead", dead),
        web.post("/api/v1/replay", replay),
        web.get("/api/v1/destinations", destinations),
        web.post("/api/v1/destinations/{ref}/{action:enable|disable}", switch_destination),
    ]
