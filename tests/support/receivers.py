"""A partner endpoint that keeps every request as it came, and the destinations commands
the destinations tests share (tests/integration/test_destinations*.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg
import pytest
from aiohttp import web
from cryptography.fernet import Fernet
from pydantic import SecretStr
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import relay as rs


@dataclass
class Received:
    path: str
    body: bytes
    headers: dict[str, str]


@dataclass
class Receiver:
    """A partner endpoint that keeps every request as it came (to verify offline with any
    secret) and answers ``status`` (200 unless a test makes it fail)."""

    port: int = 0
    status: int = 200
    requests: list[Received] = field(default_factory=list)

    def url(self, name: str = "r") -> str:
        return f"http://127.0.0.1:{self.port}/hooks/{name}"

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests.append(Received(request.path, body, dict(request.headers)))
        return web.json_response({"ok": self.status < 300}, status=self.status)


@pytest.fixture
async def receivers() -> AsyncIterator[list[Receiver]]:
    made: list[tuple[Receiver, web.AppRunner]] = []
    for _ in range(2):
        receiver = Receiver()
        app = web.Application()
        app.router.add_post("/hooks/{name}", receiver.handle)
        runner, receiver.port = await partner_mod.serve(app)
        made.append((receiver, runner))
    yield [r for r, _ in made]
    for _, runner in made:
        await runner.cleanup()


@pytest.fixture
def keyed(settings: Settings) -> Settings:
    """The test's settings with a key for destinations' own secrets."""
    return settings.model_copy(
        update={"destination_secrets_keys": [SecretStr(Fernet.generate_key().decode())]}
    )


def verifies(secret: str, request: Received) -> bool:
    try:
        Webhook(secret).verify(request.body, request.headers)
    except WebhookVerificationError:
        return False
    return True


async def add(settings: Settings, url: str, *extra: str) -> None:
    result = await rs.relay(settings, "destinations", "add", url, *extra)
    assert result.code == 0, result.stderr


async def revealed(settings: Settings, url: str) -> list[str]:
    """The destination's valid secrets, newest first, as `show --reveal-secret` prints them."""
    result = await rs.relay(settings, "destinations", "show", url, "--reveal-secret", "--json")
    assert result.code == 0, result.stderr
    return [s["secret"] for s in json.loads(result.stdout)["secrets"] if s["valid"]]


async def delivered(pool: asyncpg.Pool, n: int) -> bool:
    return (await rs.states(pool)).get("delivered", 0) == n
