"""The console's door: who is asking (a session or a bearer token), failed logins, CSRF
and the response headers.

Each operator logs in with their name and their own token (``operators``); the answer is
a server-side session (``sessions``) whose cookie is ``HttpOnly``, ``SameSite=Strict``
and, over HTTPS, ``Secure`` and ``__Host-``-prefixed. Each session has its own random CSRF
token: forms carry it, and every state-changing request must present it (compared with
``hmac.compare_digest``). Scripts send ``Authorization: Bearer TOKEN`` with
``X-Relay-Operator: NAME`` (no cookie, so no CSRF exposure). A failed login (form or
bearer) is one WARNING line (the client's address; never the token), counted in
``relay_console_login_failures_total``; five from one address within a minute block it
(``throttle``: 429 with ``Retry-After``). Read pages need a session or a token unless
``RELAY_CONSOLE_OPEN_READS`` is on.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Middleware
from opentelemetry.metrics import Counter

from service import logs
from service.ops.console import operators as ops
from service.ops.console import sessions as sess
from service.ops.console import throttle as thr

log = logs.get("console")
OPEN_PATHS = ("/login", "/static/", "/metrics")

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
HSTS = {"Strict-Transport-Security": "max-age=31536000"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Operator:
    """Who is asking: a name, and the session's CSRF token (None for bearer clients)."""

    name: str
    csrf: str | None


@dataclass(frozen=True)
class Refusal:
    """A login refused: the status (401, 429), what to say, and for 429 the wait (s)."""

    status: int
    why: str
    retry_after: int | None = None


class Door:
    """Logs operators in and out and tells who a request is from."""

    def __init__(
        self,
        operators: ops.Operators,
        sessions: sess.Sessions,
        throttle: thr.LoginThrottle,
        failures: Counter,
        *,
        open_reads: bool = False,
        proxy_hops: int = 0,
    ) -> None:
        self.operators = operators
        self.sessions = sessions
        self.throttle = throttle
        self.failures = failures
        self.open_reads = open_reads
        self.proxy_hops = proxy_hops

    @property
    def cookie(self) -> str:
        return self.sessions.policy.cookie

    @property
    def headers(self) -> dict[str, str]:
        return HEADERS | HSTS if self.sessions.policy.https else HEADERS

    async def login(self, request: web.Request, name: str, token: str) -> str | Refusal:
        """A new session's cookie value for ``name`` if ``token`` is theirs."""
        address = thr.client_address(request, self.proxy_hops)
        wait = self.throttle.wait_seconds(address)
        if wait > 0:
            return self._throttled(address, wait)
        entry = await self.operators.verify(name, token)
        if entry is None:
            return self._failed(address, name)
        self.throttle.succeeded(address)
        return await self.sessions.open(entry.name, entry.credential)

    async def bearer(self, request: web.Request) -> Operator | Refusal | None:
        """The operator of ``Authorization: Bearer`` (None: no such header)."""
        header = request.headers.get("Authorization")
        if header is None:
            return None
        address = thr.client_address(request, self.proxy_hops)
        wait = self.throttle.wait_seconds(address)
        if wait > 0:
            return self._throttled(address, wait)
        name = request.headers.get("X-Relay-Operator", "").strip()
        token = header[7:].strip() if header.startswith("Bearer ") else ""
        entry = await self.operators.verify(name, token)
        if entry is None:
            return self._failed(address, name)
        return Operator(entry.name, None)

    async def session(self, request: web.Request) -> Operator | None:
        """The operator of a live session cookie, or None."""
        cookie = request.cookies.get(self.cookie)
        found = await self.sessions.find(cookie)
        if found is None or cookie is None:
            return None
        if self.operators.credential_of(found.operator) != found.credential:
            await self.sessions.revoke(cookie, "operator_gone")  # removed, or a new token
            return None
        return Operator(found.operator, found.csrf)

    async def logout(self, request: web.Request) -> None:
        cookie = request.cookies.get(self.cookie)
        if cookie:
            await self.sessions.revoke(cookie, "logout")

    def set_cookie(self, response: web.StreamResponse, value: str) -> None:
        policy = self.sessions.policy
        response.set_cookie(
            self.cookie,
            value,
            httponly=True,
            samesite="Strict",
            secure=policy.https,
            max_age=int(policy.absolute_seconds),
            path="/",
        )

    def clear_cookie(self, response: web.StreamResponse) -> None:
        policy = self.sessions.policy
        response.del_cookie(self.cookie, path="/", secure=policy.https, samesite="Strict")

    def _failed(self, address: str, name: str) -> Refusal:
        blocked = self.throttle.failed(address)
        known = name in self.operators.current()
        self.failures.add(1, {"reason": "wrong_token"})
        # The address and whether the name is an operator's: never the token, nor a name
        # that is none (someone may have typed their token into it).
        fields = {"event": "console_login_failed", "remote": address, "operator_known": known}
        log.warning("console login failed", extra=fields | ({"operator": name} if known else {}))
        if blocked:
            log.warning(
                "console logins blocked for an address",
                extra={"event": "console_login_blocked", "remote": address, "seconds": blocked},
            )
        return Refusal(401, "wrong name or token")

    def _throttled(self, address: str, wait: float) -> Refusal:
        self.failures.add(1, {"reason": "throttled"})
        log.warning(
            "console login refused: too many failures",
            extra={"event": "console_login_throttled", "remote": address},
        )
        return Refusal(429, "too many failed logins from your address", math.ceil(wait))


# Who the request is from (None: an open read without a login).
OPERATOR: web.RequestKey[Operator | None] = web.RequestKey("operator")


def is_api(request: web.Request) -> bool:
    return request.path.startswith("/api/")


def refuse(request: web.Request, refusal: Refusal) -> web.Response:
    """The refusal as JSON for the API, as a short page otherwise."""
    headers = {"Retry-After": str(refusal.retry_after)} if refusal.retry_after else None
    if is_api(request):
        return web.json_response({"error": refusal.why}, status=refusal.status, headers=headers)
    text = (
        f"<!doctype html><title>Refused</title><p>{refusal.why}</p>"
        "<p><a href='/login'>Log in</a></p>"
    )
    return web.Response(text=text, status=refusal.status, content_type="text/html", headers=headers)


async def csrf_ok(request: web.Request, operator: Operator) -> bool:
    """A cookie session's state-changing request carries its CSRF token."""
    if operator.csrf is None:  # a bearer client: no ambient credential to forge with
        return True
    presented = request.headers.get("X-CSRF-Token")
    if presented is None and request.content_type in (
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ):
        presented = str((await request.post()).get("csrf", ""))
    return presented is not None and hmac.compare_digest(presented, operator.csrf)


def same_origin(request: web.Request) -> bool:
    """What a browser says of where a request comes from, when it says it, is this console.

    ``Sec-Fetch-Site`` must be ``same-origin`` (or ``none``: typed by the user). An
    ``Origin`` must name this console, except ``null``: under ``Referrer-Policy:
    no-referrer`` a browser sends that for its own forms (the CSRF token still decides).
    """
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("Origin")
    return origin in (None, "null", f"http://{request.host}", f"https://{request.host}")


def middleware(door: Door) -> Middleware:
    """Headers on every answer; authentication and CSRF before every handler."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await _checked(door, request, handler)
        except web.HTTPException as exc:  # a redirect or a 404 gets the headers too
            exc.headers.update(door.headers)
            raise
        response.headers.update(door.headers)
        return response

    return guard


async def _checked(door: Door, request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith(OPEN_PATHS):
        return await handler(request)
    reading = request.method in ("GET", "HEAD")
    operator = await door.bearer(request)
    if isinstance(operator, Refusal):
        return refuse(request, operator)
    operator = operator or await door.session(request)
    if operator is None:
        if reading and door.open_reads:
            request[OPERATOR] = None
            return await handler(request)
        if reading and not is_api(request):
            raise web.HTTPSeeOther("/login")
        return refuse(request, Refusal(401, "an operator's name and token are required"))
    if not reading:
        if not same_origin(request):
            return refuse(request, Refusal(403, "cross-origin request refused"))
        if not await csrf_ok(request, operator):
            return refuse(request, Refusal(403, "missing or wrong CSRF token"))
    request[OPERATOR] = operator
    return await handler(request)
