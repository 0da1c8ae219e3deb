"""A Resend-shaped e-mail API on 127.0.0.1 for tests: honours Idempotency-Key, counts."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from service.ops import partner as partner_mod

API_KEY = "re_test"
SENDER = "Holds <holds@example.com>"


@dataclass
class FakeEmailApi:
    """A Resend-shaped ``POST /emails`` that honours Idempotency-Key and counts."""

    port: int = 0
    requests: Counter[str] = field(default_factory=Counter)  # key -> requests
    first_body: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> body
    ids: dict[str, str] = field(default_factory=dict)  # key -> email id answered
    unauthorized: int = 0

    async def emails(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            self.unauthorized += 1
            return web.json_response(
                {"statusCode": 401, "name": "missing_api_key", "message": "no"}, status=401
            )
        key = request.headers.get("Idempotency-Key", "")
        body = await request.json()
        self.requests[key] += 1
        if key not in self.ids:  # a repeated key gets the original answer, no new email
            self.ids[key] = f"email-{len(self.ids) + 1}"
            self.first_body[key] = body
        return web.json_response({"id": self.ids[key]})


@asynccontextmanager
async def serve_email_api() -> AsyncIterator[FakeEmailApi]:
    """``POST /emails`` on a free port; ``api.port`` says which."""
    api = FakeEmailApi()
    app = web.Application()
    app.router.add_post("/emails", api.emails)
    runner, api.port = await partner_mod.serve(app)
    yield api
    await runner.cleanup()
