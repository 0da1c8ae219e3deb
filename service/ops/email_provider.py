"""A local Resend-style e-mail provider for the demo and the tests, with real receipts.

``POST /emails`` takes a message (bearer key, ``Idempotency-Key`` honoured: a repeated key
gets the first answer and sends nothing), then posts Svix-signed status events for it to
the receipts URL over HTTP, some after a delay, as the recipient's address says:

=====================  ==========================================================
local part starts with  events (after ``delay_seconds`` each)
=====================  ==========================================================
``bounce``              email.sent, email.bounced (Permanent: a hard bounce)
``softbounce``          email.sent, email.bounced (Transient)
``complain``            email.sent, email.delivered, email.complained
``slow``                email.sent, email.delivery_delayed, email.delivered
anything else           email.sent, email.delivered
=====================  ==========================================================

``GET /emails`` lists sent e-mails newest first (``limit``, ``after``: Resend's paging), and
``GET /emails/{id}`` retrieves one: what reconciliation asks.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
from aiohttp import web
from standardwebhooks.webhooks import Webhook

API_KEY = "re_local_demo"


def sign_svix(secret: str, body: bytes, event_id: str, at: datetime) -> dict[str, str]:
    """The headers a Svix-signed delivery of ``body`` carries."""
    signature = Webhook(secret).sign(event_id, at, body.decode())
    return {
        "svix-id": event_id,
        "svix-timestamp": str(int(at.timestamp())),
        "svix-signature": signature,
        "Content-Type": "application/json",
    }


def events_for(address: str) -> list[tuple[str, dict[str, Any]]]:
    """The status events a message to ``address`` gets, in order (type, extra data)."""
    local = address.split("@", 1)[0].lower()
    if local.startswith("bounce"):
        hard = {"bounce": {"type": "Permanent", "subType": "General", "message": "no mailbox"}}
        return [("email.sent", {}), ("email.bounced", hard)]
    if local.startswith("softbounce"):
        soft = {"bounce": {"type": "Transient", "subType": "MailboxFull", "message": "full"}}
        return [("email.sent", {}), ("email.bounced", soft)]
    if local.startswith("complain"):
        return [("email.sent", {}), ("email.delivered", {}), ("email.complained", {})]
    if local.startswith("slow"):
        return [("email.sent", {}), ("email.delivery_delayed", {}), ("email.delivered", {})]
    return [("email.sent", {}), ("email.delivered", {})]


@dataclass
class EmailProvider:
    """State of one local provider; tests read ``requests``, ``emails`` and ``callbacks``."""

    webhook_url: str | None = None  # where the signed events go (relay receipts)
    webhook_secret: str | None = field(default=None, repr=False)
    delay_seconds: float = 0.0  # before each event
    callback_before_answer: bool = False  # post the events before answering the POST
    list_fails: bool = False  # the list answers 500 (a provider that cannot say)
    requests: Counter[str] = field(default_factory=Counter)  # idempotency key -> POSTs
    emails: list[dict[str, Any]] = field(default_factory=list)  # in the order sent
    by_key: dict[str, dict[str, Any]] = field(default_factory=dict)
    callbacks: list[tuple[str, int]] = field(default_factory=list)  # (event type, status)
    port: int = 0
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def send(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            return web.json_response({"statusCode": 401, "name": "missing_api_key"}, status=401)
        key = request.headers.get("Idempotency-Key", "")
        body = await request.json()
        self.requests[key] += 1
        if key and key in self.by_key:  # a repeated key: the first answer, no new e-mail
            return web.json_response({"id": self.by_key[key]["id"]})
        email = {
            "id": str(uuid.uuid4()),
            "to": body.get("to", []),
            "subject": body.get("subject"),
            "created_at": datetime.now(UTC).isoformat(),
            "last_event": "queued",
            "tags": body.get("tags", []),
        }
        self.emails.append(email)
        if key:
            self.by_key[key] = email
        events = self._post_events(email)
        if self.callback_before_answer:
            await events
        else:
            task = asyncio.get_running_loop().create_task(events)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return web.json_response({"id": email["id"]})

    async def _post_events(self, email: dict[str, Any]) -> None:
        address = (email["to"] or ["?"])[0]
        for kind, extra in events_for(address):
            if self.delay_seconds:
                await asyncio.sleep(self.delay_seconds)
            email["last_event"] = kind.removeprefix("email.")
            await self.post_event(email, kind, extra)

    async def post_event(
        self, email: dict[str, Any], kind: str, extra: dict[str, Any], event_id: str = ""
    ) -> int:
        """Post one signed event about ``email``; the receipts endpoint's status (0: none)."""
        if self.webhook_url is None or self.webhook_secret is None:
            return 0
        now = datetime.now(UTC)
        tags = {t["name"]: t["value"] for t in email["tags"] if isinstance(t, dict)}
        data = {"email_id": email["id"], "created_at": email["created_at"], "tags": tags}
        body = json.dumps({"type": kind, "created_at": now.isoformat(), "data": data | extra})
        headers = sign_svix(
            self.webhook_secret, body.encode(), event_id or f"msg_{uuid.uuid4().hex}", now
        )
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(self.webhook_url, data=body, headers=headers) as answer,
            ):
                status = answer.status
        except (aiohttp.ClientError, OSError):
            status = 0
        self.callbacks.append((kind, status))
        return status

    async def list_emails(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            return web.json_response({"statusCode": 401, "name": "missing_api_key"}, status=401)
        if self.list_fails:
            return web.json_response(
                {"statusCode": 500, "name": "internal_server_error"}, status=500
            )
        limit = min(int(request.query.get("limit", "20")), 100)
        newest_first = list(reversed(self.emails))
        after = request.query.get("after")
        if after:
            ids = [e["id"] for e in newest_first]
            newest_first = newest_first[ids.index(after) + 1 :] if after in ids else []
        page = newest_first[:limit]
        shown = [{k: v for k, v in e.items() if k != "tags"} for e in page]
        return web.json_response(
            {"object": "list", "has_more": len(newest_first) > limit, "data": shown}
        )

    async def wait_idle(self) -> None:
        """Wait until every event planned so far was posted."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/emails", self.send)
        app.router.add_get("/emails", self.list_emails)
        return app
