"""The console's HTML pages (Jinja2, autoescaped), rendered on the server.

Titles and URLs name runs and deliveries by id and destinations by reference, never an
address or a payload. Forms that change state post their session's CSRF token.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from service import control, suppressions
from service.ops.console import actions, data, params, security
from service.ops.console.app_keys import ACTIONS, DOOR, POOL, TEMPLATES, operator_name


def render(
    request: web.Request, template: str, title: str, status: int = 200, **context: Any
) -> web.Response:
    operator = request.get(security.OPERATOR)
    page = (
        request.app[TEMPLATES]
        .get_template(template)
        .render(
            title=title,
            operator=operator.name if operator else None,
            csrf=operator.csrf if operator else None,
            **context,
        )
    )
    return web.Response(text=page, status=status, content_type="text/html")


async def index(request: web.Request) -> web.StreamResponse:
    raise web.HTTPSeeOther("/runs")


async def login_form(request: web.Request) -> web.StreamResponse:
    return render(request, "login.html", "Log in")


async def login(request: web.Request) -> web.StreamResponse:
    form = await request.post()
    door = request.app[DOOR]
    name = str(form.get("name", "")).strip()
    if not security.same_origin(request) or not door.token_ok(str(form.get("token", ""))):
        return render(request, "login.html", "Log in", 401, error="wrong token")
    if not security.valid_name(name):
        return render(request, "login.html", "Log in", 400, error="say who you are (a name)")
    response = web.HTTPSeeOther("/runs")
    response.set_cookie(
        security.COOKIE,
        door.issue(name),
        httponly=True,
        samesite="Strict",
        secure=request.secure,
        max_age=security.SESSION_SECONDS,
        path="/",
    )
    raise response


async def logout(request: web.Request) -> web.StreamResponse:
    response = web.HTTPSeeOther("/login")
    response.del_cookie(security.COOKIE, path="/")
    raise response


async def runs(request: web.Request) -> web.StreamResponse:
    return render(request, "runs.html", "Runs", runs=await data.run_list(request.app[POOL]))


async def run(request: web.Request) -> web.StreamResponse:
    run_id = params.path_int(request, "run_id")
    found = await data.run_one(request.app[POOL], run_id)
    if found is None:
        raise web.HTTPNotFound(text=f"no run {run_id}")
    selection = params.missing_filter(request.query)
    rows = await data.run_missing(request.app[POOL], run_id, selection)
    more = None
    if len(rows) == data.PAGE:
        more = selection.as_query() | {"after": str(rows[-1]["id"])}
    return render(
        request,
        "run.html",
        f"Run {run_id}",
        run=found,
        actions=await data.run_actions(request.app[POOL], run_id),
        run_actions=control.ACTIONS,
        missing=rows,
        selection=selection,
        more=more,
        states=data.STATES,
        channels=data.CHANNELS,
    )


async def delivery(request: web.Request) -> web.StreamResponse:
    delivery_id = params.path_int(request, "delivery_id")
    found = await data.delivery(request.app[POOL], delivery_id)
    if found is None:
        raise web.HTTPNotFound(text=f"no delivery {delivery_id}")
    return render(request, "delivery.html", f"Delivery {delivery_id}", d=found)


async def dead(request: web.Request) -> web.StreamResponse:
    run_id = params.optional_int(request.query, "run")
    channel = params.choice(request.query, "channel", data.CHANNELS)
    found = await data.dead(request.app[POOL], run_id, channel)
    found["queue_depth"] = await request.app[ACTIONS].queue_depth()
    return render(
        request,
        "dead.html",
        "Dead letters",
        dead=found,
        run_id=run_id,
        channel=channel,
        channels=data.CHANNELS,
    )


async def replay(request: web.Request) -> web.StreamResponse:
    """Dry run (the first click) or apply (the confirmation) a replay of dead rows."""
    form = await request.post()
    wanted = params.replay_request(form)
    apply = params.flag(form, "apply")
    try:
        summary = await request.app[ACTIONS].replay_dead(
            operator_name(request), wanted, apply=apply, reason=str(form.get("reason", ""))
        )
    except actions.ActionError as exc:
        return render(request, "replay.html", "Replay", 400, error=str(exc), wanted=wanted)
    title = "Replay applied" if apply else "Replay: dry run"
    return render(request, "replay.html", title, summary=summary, wanted=wanted)


async def run_action(request: web.Request) -> web.StreamResponse:
    """Hold, release, cancel or dead-letter a run: a dry run first, then the confirmation."""
    run_id = params.path_int(request, "run_id")
    form = await request.post()
    action = str(form.get("action", ""))
    apply = params.flag(form, "apply")
    title = f"Run {run_id}: {action}"
    try:
        result = await request.app[ACTIONS].run_action(
            operator_name(request), run_id, action, apply=apply, reason=str(form.get("reason", ""))
        )
    except actions.ActionError as exc:
        return render(request, "run_action.html", title, 400, error=str(exc), run_id=run_id)
    return render(request, "run_action.html", title, result=result, run_id=run_id)


async def destinations(request: web.Request) -> web.StreamResponse:
    found = await data.destinations(request.app[POOL])
    return render(request, "destinations.html", "Destinations", destinations=found)


async def suppressions_page(request: web.Request) -> web.StreamResponse:
    """The suppression list: what is in force, and what operators lifted (read only: the
    CLI adds and removes, `relay suppressions`)."""
    channel = request.query.get("channel")
    channel = channel if channel in ("email", "sms") else None
    rows = await suppressions.listed(request.app[POOL], channel, include_removed=True, limit=500)
    return render(request, "suppressions.html", "Suppressions", rows=rows, channel=channel)


async def switch_destination(request: web.Request) -> web.StreamResponse:
    """Disable a destination, or enable one: a dry run first (its counts), then the
    confirmation."""
    form = await request.post()
    ref = params.ref(request.match_info["ref"])
    assert ref is not None  # the route's pattern requires it
    action = request.match_info["action"]
    title = f"Destination {ref}: {action}"
    try:
        result = await request.app[ACTIONS].switch_destination(
            operator_name(request),
            ref,
            enable=action == "enable",
            apply=params.flag(form, "apply"),
            reason=str(form.get("reason", "")),
        )
    except actions.ActionError as exc:
        return render(request, "destination_switch.html", title, 400, error=str(exc), ref=ref)
    return render(request, "destination_switch.html", title, result=result, ref=ref)


def routes() -> list[web.RouteDef]:
    return [
        web.get("/", index),
        web.get("/login", login_form),
        web.post("/login", login),
        web.post("/logout", logout),
        web.get("/runs", runs),
        web.get("/runs/{run_id}", run),
        web.post("/runs/{run_id}/action", run_action),
        web.get("/deliveries/{delivery_id}", delivery),
        web.get("/dead", dead),
        web.post("/replay", replay),
        web.get("/destinations", destinations),
        web.get("/suppressions", suppressions_page),
        web.post("/destinations/{ref}/{action:enable|disable}", switch_destination),
    ]
