"""A local Twilio-style SMS provider for the demo and the tests, with real receipts.

``POST /2010-04-01/Accounts/{sid}/Messages.json`` takes a message (basic auth with the
account sid and auth token; no idempotency, as at Twilio) and posts status callbacks to its
``StatusCallback`` URL, signed with ``X-Twilio-Signature`` as Twilio signs them: queued,
sent, then as the number's last digits say:

=================  ======================================================
number ends with   final status
=================  ======================================================
``0000``           undelivered, ErrorCode 30005 (unknown handset: permanent)
``1111``           failed, ErrorCode 30008 (unknown error: may pass next time)
anything else      delivered
=================  ======================================================

``GET .../Messages.json?To=...`` lists messages newest first (``PageSize``): what
reconciliation asks.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Any

import aiohttp
from aiohttp import web

from service import receipt_signatures

ACCOUNT_SID = "AC" + "0" * 31 + "1"
AUTH_TOKEN = "local-demo-auth-token"
FROM_NUMBER = "+15005550006"


def final_status(number: str) -> tuple[str, str | None]:
    """The last status a message to ``number`` gets, and its ErrorCode."""
    if number.endswith("0000"):
        return "undelivered", "30005"
    if number.endswith("1111"):
        return "failed", "30008"
    return "delivered", None


@dataclass
class SmsProvider:
    """State of one local provider; tests read ``messages`` and ``callbacks``."""

    auth_token: str = field(default=AUTH_TOKEN, repr=False)
    delay_seconds: float = 0.0  # before each status callback
    callback_before_answer: bool = False  # post the callbacks before answering the POST
    list_fails: bool = False  # the list answers 500 (a provider that cannot say)
    # Set by a test to make the list wait for it (a slow provider); None: answer at once.
    list_gate: asyncio.Event | None = None
    lists: int = 0  # list requests received
    messages: list[dict[str, Any]] = field(default_factory=list)  # in the order sent
    requests: Counter[str] = field(default_factory=Counter)  # To -> POSTs
    callbacks: list[tuple[str, int]] = field(default_factory=list)  # (status, answer)
    port: int = 0
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def _authorized(self, request: web.Request) -> bool:
        expected = base64.b64encode(f"{ACCOUNT_SID}:{self.auth_token}".encode()).decode()
        return request.headers.get("Authorization") == f"Basic {expected}"

    async def send(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"code": 20003, "status": 401}, status=401)
        form = await request.post()
        to = str(form.get("To", ""))
        self.requests[to] += 1
        message = {
            "sid": "SM" + secrets.token_hex(16),
            "to": to,
            "body": str(form.get("Body", "")),
            "status": "queued",
            "date_created": format_datetime(datetime.now(UTC), usegmt=True),
            "callback": str(form.get("StatusCallback", "")) or None,
        }
        self.messages.append(message)
        statuses = self._post_statuses(message)
        if self.callback_before_answer:
            await statuses
        else:
            task = asyncio.get_running_loop().create_task(statuses)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        shown = {k: v for k, v in message.items() if k != "callback"}
        return web.json_response(shown, status=201)

    async def _post_statuses(self, message: dict[str, Any]) -> None:
        final, code = final_status(message["to"])
        for status, error in (("queued", None), ("sent", None), (final, code)):
            if self.delay_seconds:
                await asyncio.sleep(self.delay_seconds)
            message["status"] = status
            await self.post_status(message, status, error)

    async def post_status(self, message: dict[str, Any], status: str, error: str | None) -> int:
        """Post one signed status callback about ``message``; the answer's status."""
        url = message["callback"]
        if not url:
            return 0
        params = {
            "AccountSid": ACCOUNT_SID,
            "MessageSid": message["sid"],
            "SmsSid": message["sid"],
            "MessageStatus": status,
            "SmsStatus": status,
            "To": message["to"],
            "From": FROM_NUMBER,
            "ApiVersion": "2010-04-01",
        }
        if error is not None:
            params["ErrorCode"] = error
        signature = receipt_signatures.twilio_signature(self.auth_token, url, params.items())
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(url, data=params, headers={"X-Twilio-Signature": signature}) as a,
            ):
                answer = a.status
        except (aiohttp.ClientError, OSError):
            answer = 0
        self.callbacks.append((status, answer))
        return answer

    async def list_messages(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"code": 20003, "status": 401}, status=401)
        self.lists += 1
        if self.list_gate is not None:
            await self.list_gate.wait()
        if self.list_fails:
            return web.json_response({"code": 20500, "status": 500}, status=500)
        to = request.query.get("To")
        size = min(int(request.query.get("PageSize", "50")), 1000)
        found = [m for m in reversed(self.messages) if to is None or m["to"] == to]
        shown = [{k: v for k, v in m.items() if k != "callback"} for m in found[:size]]
        return web.json_response({"messages": shown, "next_page_uri": None})

    async def wait_idle(self) -> None:
        """Wait until every callback planned so far was posted."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def app(self) -> web.Application:
        app = web.Application()
        path = f"/2010-04-01/Accounts/{ACCOUNT_SID}/Messages.json"
        app.router.add_post(path, self.send)
        app.router.add_get(path, self.list_messages)
        return app
