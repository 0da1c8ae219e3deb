"""The console's door: the operator token, the session cookie, CSRF, response headers.

A browser logs in once with the token and a name; the answer sets an HttpOnly,
SameSite=Strict cookie holding the name, a random session id, the time and an HMAC of
them keyed by the token (so rotating the token ends every session). Each session's CSRF
token is another HMAC of its id: forms carry it, and every state-changing request must
present it (compared with ``hmac.compare_digest``). Scripts send the token itself as
``Authorization: Bearer`` (no cookie, so no CSRF exposure) and name themselves in
``X-Relay-Operator``. Read pages need a session or the token unless
``RELAY_CONSOLE_OPEN_READS`` is on.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Middleware

from service import errors
from service.settings import Settings

COOKIE = "relay_console"
SESSION_SECONDS = 12 * 3600
MIN_TOKEN_CHARS = 16
_NAME = re.compile(r"^[\w.@ -]{1,64}$")
OPEN_PATHS = ("/login", "/static/")

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def load_token(settings: Settings) -> str:
    """The operator token from RELAY_CONSOLE_TOKEN or the file RELAY_CONSOLE_TOKEN_FILE."""
    if settings.console_token_file is not None:
        try:
            token = settings.console_token_file.read_text("utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise errors.ConfigError(f"RELAY_CONSOLE_TOKEN_FILE: cannot read it ({exc})") from None
        setting = "RELAY_CONSOLE_TOKEN_FILE"
    elif settings.console_token is not None:
        token, setting = settings.console_token.get_secret_value().strip(), "RELAY_CONSOLE_TOKEN"
    else:
        raise errors.ConfigError(
            "RELAY_CONSOLE_TOKEN: the console needs an operator token "
            "(RELAY_CONSOLE_TOKEN or RELAY_CONSOLE_TOKEN_FILE)"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise errors.ConfigError(f"{setting}: the token must have {MIN_TOKEN_CHARS}+ characters")
    return token


@dataclass(frozen=True)
class Operator:
    """Who is asking: a name, and the session's CSRF token (None for bearer clients)."""

    name: str
    csrf: str | None


class Door:
    """Checks tokens, issues and verifies session cookies and CSRF tokens."""

    def __init__(self, token: str, *, open_reads: bool, now: Callable[[], float] = time.time):
        self._token = token.encode()
        self._key = hmac.new(self._token, b"relay-console-session", hashlib.sha256).digest()
        self.open_reads = open_reads
        self._now = now

    def token_ok(self, presented: str) -> bool:
        return hmac.compare_digest(presented.encode(), self._token)

    def _sign(self, text: str) -> str:
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def csrf_for(self, session_id: str) -> str:
        return self._sign(f"csrf:{session_id}")

    def issue(self, name: str) -> str:
        """A new session cookie value for ``name``."""
        encoded = base64.urlsafe_b64encode(name.encode()).decode()
        body = f"{encoded}.{secrets.token_hex(16)}.{int(self._now())}"
        return f"{body}.{self._sign(body)}"

    def session(self, cookie: str | None) -> Operator | None:
        """The operator of a valid, unexpired cookie, or None."""
        if not cookie or cookie.count(".") != 3:
            return None
        body, signature = cookie.rsplit(".", 1)
        if not hmac.compare_digest(signature, self._sign(body)):
            return None
        encoded, session_id, issued = body.split(".")
        try:
            name = base64.urlsafe_b64decode(encoded).decode()
            expired = self._now() - int(issued) > SESSION_SECONDS
        except (ValueError, binascii.Error, UnicodeDecodeError):
            return None
        return None if expired else Operator(name, self.csrf_for(session_id))

    def bearer(self, request: web.Request) -> Operator | None:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or not self.token_ok(header[7:].strip()):
            return None
        name = request.headers.get("X-Relay-Operator", "api")
        return Operator(name if valid_name(name) else "api", None)


# Who the request is from (None: an open read without a login).
OPERATOR: web.RequestKey[Operator | None] = web.RequestKey("operator")


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


def is_api(request: web.Request) -> bool:
    return request.path.startswith("/api/")


def refuse(request: web.Request, status: int, why: str) -> web.Response:
    """401/403 as JSON for the API, as a short page otherwise."""
    if is_api(request):
        return web.json_response({"error": why}, status=status)
    text = f"<!doctype html><title>Refused</title><p>{why}</p><p><a href='/login'>Log in</a></p>"
    return web.Response(text=text, status=status, content_type="text/html")


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
            exc.headers.update(HEADERS)
            raise
        response.headers.update(HEADERS)
        return response

    return guard


async def _checked(door: Door, request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith(OPEN_PATHS):
        return await handler(request)
    reading = request.method in ("GET", "HEAD")
    operator = door.bearer(request) or door.session(request.cookies.get(COOKIE))
    if operator is None:
        if reading and door.open_reads:
            request[OPERATOR] = None
            return await handler(request)
        if reading and not is_api(request):
            raise web.HTTPSeeOther("/login")
        return refuse(request, 401, "the operator token is required")
    if not reading:
        if not same_origin(request):
            return refuse(request, 403, "cross-origin request refused")
        if not await csrf_ok(request, operator):
            return refuse(request, 403, "missing or wrong CSRF token")
    request[OPERATOR] = operator
    return await handler(request)
