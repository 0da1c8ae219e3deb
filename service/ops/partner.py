"""The demo partner endpoint: a receiver that honours idempotency keys and counts.

It stands in for a partner's webhook receiver in the demo, the tests and the
benchmarks. A request with a key it has seen is answered like the first one and
counted as a duplicate, never as a second logical event. Behaviour per path can be
set to fail (status, for a while), to be slow, or to verify Standard Webhooks
signatures. ``GET /stats`` returns the counts as JSON.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

KEY_HEADER = "Idempotency-Key"


@dataclass
class PathRule:
    """How one path (``/hooks/<name>``) answers new keys."""

    status: int = 200
    until_monotonic: float | None = None  # the rule applies until then; afterwards 200
    delay_seconds: float = 0.0  # answer late (hang: a very large value)
    retry_after: str | None = None
    first_n: int | None = None  # fail only the first n requests to this path
    first_n_per_key: int | None = None  # fail only the first n requests of each key


@dataclass
class Partner:
    """State of one partner server; inspect ``events`` and ``duplicates`` in tests."""

    verify_secret: str | None = None
    rules: dict[str, PathRule] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)  # key -> requests seen with it
    accepted: dict[str, str] = field(default_factory=dict)  # key -> path it was accepted at
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each request
    requests_by_path: Counter[str] = field(default_factory=Counter)
    failures_by_key: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    bad_signatures: int = 0
    last_headers: dict[str, str] = field(default_factory=dict)
    on_request: Callable[[str, str], None] | None = None  # (path name, key) hook for tests

    @property
    def logical_events(self) -> int:
        return len(self.accepted)

    def stats(self) -> dict[str, Any]:
        return {
            "requests": sum(self.requests_by_path.values()),
            "logical_events": self.logical_events,
            "duplicates": self.duplicates,
            "bad_signatures": self.bad_signatures,
            "by_path": dict(self.requests_by_path),
        }

    def _verify(self, request: web.Request, body: bytes) -> bool:
        if self.verify_secret is None:
            return True
        from standardwebhooks.webhooks import Webhook, WebhookVerificationError

        try:
            Webhook(self.verify_secret).verify(body, dict(request.headers))
        except WebhookVerificationError:
            return False
        return True

    async def handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = await request.read()
        key = request.headers.get(KEY_HEADER) or request.headers.get("webhook-id") or ""
        self.arrivals.append(time.monotonic())
        self.requests_by_path[name] += 1
        self.last_headers = {k.lower(): v for k, v in request.headers.items()}
        if self.on_request is not None:
            self.on_request(name, key)
        if not self._verify(request, body):
            self.bad_signatures += 1
            return web.json_response({"error": "bad signature"}, status=401)
        if not key:
            return web.json_response({"error": "missing Idempotency-Key"}, status=400)
        if key in self.accepted:
            # The same logical event again: answer as before, count it, do nothing new.
            self.events[key] += 1
            self.duplicates += 1
            return web.json_response({"received": key, "duplicate": True})
        rule = self.rules.get(name)
        if rule is not None:
            if rule.delay_seconds:
                await asyncio.sleep(rule.delay_seconds)
            active = rule.until_monotonic is None or time.monotonic() < rule.until_monotonic
            if rule.first_n is not None:
                active = active and self.requests_by_path[name] <= rule.first_n
            if rule.first_n_per_key is not None:
                self.failures_by_key[key] += 1
                active = active and self.failures_by_key[key] <= rule.first_n_per_key
            if active and rule.status >= 300:
                headers = {"Retry-After": rule.retry_after} if rule.retry_after else None
                return web.json_response(
                    {"error": f"status {rule.status}"}, status=rule.status, headers=headers
                )
        self.events[key] = self.events.get(key, 0) + 1
        self.accepted[key] = name
        return web.json_response(
            {"received": key}, status=200, headers={"X-Request-Id": f"partner-{len(self.accepted)}"}
        )

    async def handle_stats(self, _: web.Request) -> web.Response:
        return web.json_response(self.stats())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024 * 1024)
        app.router.add_post("/hooks/{name}", self.handle)
        app.router.add_get("/stats", self.handle_stats)
        return app


async def start(
    partner: Partner, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Serve ``partner``; return the runner (for cleanup) and the bound port."""
    return await serve(partner.app(), host, port)


async def serve(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Serve any aiohttp app (port 0: a free one); return the runner and the bound port."""
    # A hanging handler is abandoned on cleanup rather than awaited for a minute.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, int(bound)
