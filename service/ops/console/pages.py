"""The console's HTML pages (Jinja2, autoescaped), rendered on the server.

Titles and URLs name runs and deliveries by id and destinations by reference, never an
address or a payload. Forms that change state post their session's CSRF token. A page
with recipients or replies on it shows them redacted; its Reveal button posts to the same
address, which records the reveal (who, when, which page) and shows the page unredacted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from service.ledger import control
from service.ops.console import actions, data, params, security
from service.ops.console.app_keys import ACTIONS, DOOR, POOL, REF_KEY, TEMPLATES, operator_name

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Shown = Callable[[web.Request, bool], Awaitable[web.StreamResponse]]


def render(
    request: web.Request, template: str, title: str, status: int = 200, **context: Any
) -> web.Response:
    operator = request.get(security.OPERATOR)
    context.setdefault("revealed", False)
    page = (
        request.app[TEMPLATES]
        .get_template(template)
        .render(
            title=title,
            operator=operator.name if operator else None,
            csrf=operator.csrf if operator else None,
            here=request.path_qs,
            **context,
        )
    )
    return web.Response(text=page, status=status, content_type="text/html")


def revealing(show: Shown) -> tuple[Handler, Handler]:
    """The GET handler of a page with private data (redacted) and its POST (revealed,
    recorded first)."""

    async def get(request: web.Request) -> web.StreamResponse:
        return await show(request, False)

    async def post(request: web.Request) -> web.StreamResponse:
        if not params.flag(await request.post(), "reveal"):
            raise params.bad("reveal", "this page only reveals (reveal=1)")
        await request.app[ACTIONS].reveal(operator_name(request), request.path_qs)
        return await show(request, True)

    return get, post


async def index(request: web.Request) -> web.StreamResponse:
    raise web.HTTPSeeOther("/runs")


async def login_form(request: web.Request) -> web.StreamResponse:
    return render(request, "login.html", "Log in")


async def login(request: web.Request) -> web.StreamResponse:
    """Name and token: a new session, or the refusal (401; 429 while the address waits)."""
    if not security.same_origin(request):
        return render(request, "login.html", "Log in", 403, error="cross-origin log-in refused")
    form = await request.post()
    door = request.app[DOOR]
    name = str(form.get("name", "")).strip()
    outcome = await door.login(request, name, str(form.get("token", "")))
    if isinstance(outcome, security.Refusal):
        page = render(request, "login.html", "Log in", outcome.status, error=outcome.why)
        if outcome.retry_after is not None:
            page.headers["Retry-After"] = str(outcome.retry_after)
        return page
    response = web.HTTPSeeOther("/runs")
    door.set_cookie(response, outcome)
    raise response


async def logout(request: web.Request) -> web.StreamResponse:
    """End the session on the server (its cookie is worthless from now on)."""
    door = request.app[DOOR]
    await door.logout(request)
    response = web.HTTPSeeOther("/login")
    door.clear_cookie(response)
    raise response


async def runs(request: web.Request) -> web.StreamResponse:
    return render(request, "runs.html", "Runs", runs=await data.run_list(request.app[POOL]))


async def run(request: web.Request, reveal: bool) -> web.StreamResponse:
    run_id = params.path_int(request, "run_id")
    found = await data.run_one(request.app[POOL], run_id)
    if found is None:
        raise web.HTTPNotFound(text=f"no run {run_id}")
    selection = params.missing_filter(request.query)
    key = request.app[REF_KEY]
    rows = await data.run_missing(request.app[POOL], key, run_id, selection, reveal=reveal)
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
        revealed=reveal,
    )


async def delivery(request: web.Request, reveal: bool) -> web.StreamResponse:
    delivery_id = params.path_int(request, "delivery_id")
    key = request.app[REF_KEY]
    found = await data.delivery(request.app[POOL], key, delivery_id, reveal=reveal)
    if found is None:
        raise web.HTTPNotFound(text=f"no delivery {delivery_id}")
    title = f"Delivery {delivery_id}"
    return render(request, "delivery.html", title, d=found, revealed=reveal)


async def dead(request: web.Request, reveal: bool) -> web.StreamResponse:
    run_id = params.optional_int(request.query, "run")
    channel = params.choice(request.query, "channel", data.CHANNELS)
    found = await data.dead(request.app[POOL], run_id, channel, reveal=reveal)
    found["queue_depth"] = await request.app[ACTIONS].queue_depth()
    return render(
        request,
        "dead.html",
        "Dead letters",
        dead=found,
        run_id=run_id,
        channel=channel,
        channels=data.CHANNELS,
        revealed=reveal,
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


async def destinations(request: web.Request, reveal: bool) -> web.StreamResponse:
    found = await data.destinations(request.app[POOL], request.app[REF_KEY], reveal=reveal)
    return render(request, "destinations.html", "Destinations", destinations=found, revealed=reveal)


async def suppressions_page(request: web.Request, reveal: bool) -> web.StreamResponse:
    """The suppression list: what is in force, and what operators lifted (read only: the
    CLI adds and removes, `relay suppressions`). Addresses are redacted until revealed."""
    channel = params.choice(request.query, "channel", ("email", "sms"))
    rows = await data.suppression_list(
        request.app[POOL], request.app[REF_KEY], channel, reveal=reveal
    )
    return render(
        request, "suppressions.html", "Suppressions", rows=rows, channel=channel, revealed=reveal
    )


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


def _page(path: str, show: Shown) -> list[web.RouteDef]:
    get, post = revealing(show)
    return [web.get(path, get), web.post(path, post)]


def routes() -> list[web.RouteDef]:
    return [
        web.get("/", index),
        web.get("/login", login_form),
        web.post("/login", login),
        web.post("/logout", logout),
        web.get("/runs", runs),
        *_page("/runs/{run_id}", run),
        web.post("/runs/{run_id}/action", run_action),
        *_page("/deliveries/{delivery_id}", delivery),
        *_page("/dead", dead),
        web.post("/replay", replay),
        *_page("/destinations", destinations),
        *_page("/suppressions", suppressions_page),
        web.post("/destinations/{ref}/{action:enable|disable}", switch_destination),
    ]
