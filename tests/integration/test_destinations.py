"""The destinations registry against real PostgreSQL, RabbitMQ and HTTP servers: each
partner's own secret, rotation with a grace, auto-disable on a failure streak with held
deliveries, the event envelope, and no secret in any log."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest
from aiohttp import web
from cryptography.fernet import Fernet
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from service import destinations, outbox
from service.ops import partner as partner_mod
from service.settings import Settings
from tests.conftest import SECRET
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
        update={"destination_secrets_keys": [_secret_str(Fernet.generate_key().decode())]}
    )


def _secret_str(value: str) -> object:
    from pydantic import SecretStr

    return SecretStr(value)


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


async def test_two_partners_each_verify_only_their_own_secret(
    keyed: Settings, pool: asyncpg.Pool, receivers: list[Receiver]
) -> None:
    a, b = receivers
    for receiver in receivers:
        await add(keyed, receiver.url())
    secret_a, secret_b = (await revealed(keyed, a.url()))[0], (await revealed(keyed, b.url()))[0]
    assert secret_a != secret_b
    lines = [rs.line(f"a{i}", a.url()) for i in range(10)]
    lines += [rs.line(f"b{i}", b.url()) for i in range(10)]
    await rs.load(pool, lines)
    assert (await rs.relay(keyed, "publish")).code == 0
    async with rs.consumer_in_process(keyed):
        await rs.wait_for(lambda: delivered(pool, 20), 30, "20 delivered")

    assert len(a.requests) == len(b.requests) == 10
    pairs = ((secret_a, secret_b, a.requests), (secret_b, secret_a, b.requests))
    for own, other, requests in pairs:
        assert [verifies(own, r) for r in requests] == [True] * 10
        assert [verifies(other, r) for r in requests] == [False] * 10  # 0 cross-accepts
        # Nor does the shared fallback secret verify a destination with its own.
        assert [verifies(SECRET, r) for r in requests] == [False] * 10
    # The stored secrets are encrypted: neither plaintext is in the database.
    stored = await pool.fetch("SELECT encrypted FROM destination_secrets")
    assert len(stored) == 2
    assert all(secret_a not in r["encrypted"] and secret_b not in r["encrypted"] for r in stored)


async def test_an_unknown_destination_is_registered_on_first_use_or_refused_when_registered_only(
    keyed: Settings, pool: asyncpg.Pool, receivers: list[Receiver]
) -> None:
    a, b = receivers
    first_use = rs.line("first", a.url().replace("http://127.0.0.1", "HTTP://127.0.0.1"))
    loaded = await rs.relay(keyed, "reminders", "load", "-", stdin=first_use + "\n")
    assert loaded.code == 0, loaded.stderr
    shown = json.loads((await rs.relay(keyed, "destinations", "show", a.url(), "--json")).stdout)
    assert shown["url"] == a.url() and shown["state"] == "enabled"  # normalised
    assert [s["valid"] for s in shown["secrets"]] == [True] and "secret" not in shown["secrets"][0]
    assert await pool.fetchval("SELECT destination FROM reminders") == a.url()

    refused = await rs.relay(
        keyed, "reminders", "load", "-", stdin=rs.line("second", b.url()) + "\n",
        DESTINATIONS_REGISTERED_ONLY="true",
    )  # fmt: skip
    assert refused.code == 2
    assert "destination not registered" in refused.stderr
    assert await pool.fetchval("SELECT count(*) FROM reminders") == 1
    async with pool.acquire() as conn, conn.transaction():
        with pytest.raises(outbox.InvalidIntentError, match="not registered"):
            await outbox.add_intent(
                conn, key="k1", channel="webhook", destination=b.url(), payload={"n": 1},
                allow_networks=rs.LOOPBACK,
                registration=destinations.Registration(registered_only=True),
            )  # fmt: skip
    assert await pool.fetchval("SELECT count(*) FROM destinations WHERE url = $1", b.url()) == 0


async def test_json_output_holds_no_secret_without_reveal_secret(
    keyed: Settings, receivers: list[Receiver]
) -> None:
    url = receivers[0].url()
    await add(keyed, url)
    secret = (await revealed(keyed, url))[0]
    assert secret.startswith("whsec_")
    rotated = await rs.relay(keyed, "destinations", "rotate-secret", url, "--grace", "1h", "--json")
    assert rotated.code == 0, rotated.stderr
    for args in (("show", url, "--json"), ("show", url), ("list", "--json"), ("list",)):
        result = await rs.relay(keyed, "destinations", *args)
        assert result.code == 0, result.stderr
        assert "whsec_" not in result.stdout + result.stderr
    assert len(await revealed(keyed, url)) == 2  # the new one and the old one in its grace
    listed = json.loads((await rs.relay(keyed, "destinations", "list", "--json")).stdout)
    assert [(d["url"], d["secrets"], d["state"]) for d in listed["destinations"]] == [
        (url, 2, "enabled")
    ]


class Records(logging.Handler):
    """Keeps the relay's log records (the consumer runs in this process)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def events(self, event: str) -> list[logging.LogRecord]:
        return [r for r in self.records if getattr(r, "event", None) == event]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("relay")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.timeout(120)
async def test_a_failure_streak_disables_the_destination_holds_its_deliveries_then_enable_sends(
    keyed: Settings, pool: asyncpg.Pool, receivers: list[Receiver], records: Records
) -> None:
    failing, healthy = receivers
    failing.status = 503
    settings = keyed.model_copy(
        update={
            "destination_failure_streak": 3,
            "destination_failure_span_seconds": 0.5,
            "destination_hold_seconds": 1.0,
            "max_attempts": 50,  # the streak, not the attempt budget, must stop the sends
            # The circuit breaker would defer the sends (no attempt, no streak) for its
            # cooldown: kept out of the way here, it is not what this test is about.
            "breaker_failure_threshold": 1000,
        }
    )
    await rs.load(pool, [rs.line(f"f{i}", failing.url()) for i in range(5)]
                  + [rs.line(f"h{i}", healthy.url()) for i in range(3)])  # fmt: skip
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings) as consumer:

        async def held_five() -> bool:
            held = {r.delivery_id for r in records.events("deferred")
                    if r.reason == "destination disabled"}  # type: ignore[attr-defined]  # fmt: skip
            return len(held) == 5

        await rs.wait_for(held_five, 60, "all five deliveries held")
        shown = json.loads(
            (await rs.relay(settings, "destinations", "show", failing.url(), "--json")).stdout
        )
        assert (shown["state"], shown["disabled_reason"]) == ("disabled", "failure streak")
        assert shown["failure_streak"] >= 3
        requests_when_held = len(failing.requests)
        attempts_when_held = await pool.fetchval("SELECT count(*) FROM delivery_attempts")
        rounds = len(records.events("deferred"))
        # Another round of holds: still no request, no attempt.
        await rs.wait_for(
            lambda: _more(records, rounds + 5), 30, "held deliveries looked again"
        )
        assert len(failing.requests) == requests_when_held
        assert await pool.fetchval("SELECT count(*) FROM delivery_attempts") == attempts_when_held
        states = await rs.states(pool)
        assert states.get("dead", 0) == 0 and states["retrying"] == 5
        assert states["delivered"] == 3  # the healthy partner is not affected
        assert consumer.metric("relay.destinations.disabled", reason="failure_streak") == 1
        [event] = records.events("destination_disabled")
        assert event.reason == "failure_streak"  # type: ignore[attr-defined]
        assert event.destination_id == shown["id"]  # type: ignore[attr-defined]

        failing.status = 200
        enabled = await rs.relay(settings, "destinations", "enable", failing.url(), "--json")
        assert enabled.code == 0, enabled.stderr
        assert json.loads(enabled.stdout)["held"] == 5
        await rs.wait_for(lambda: delivered(pool, 8), 30, "all delivered after enable")
        assert consumer.metric("relay.delivery.dead_letters") == 0
    assert await pool.fetchval("SELECT count(*) FROM deliveries WHERE state = 'dead'") == 0
    after = json.loads(
        (await rs.relay(settings, "destinations", "show", failing.url(), "--json")).stdout
    )
    assert (after["state"], after["failure_streak"]) == ("enabled", 0)


async def _more(records: Records, n: int) -> bool:
    return len(records.events("deferred")) >= n


async def _send_one(settings: Settings, pool: asyncpg.Pool, reminder_id: str, url: str) -> None:
    """Load one reminder due now, publish it and wait until it is delivered."""
    await rs.load(pool, [rs.line(reminder_id, url)])
    assert (await rs.relay(settings, "publish")).code == 0

    async def sent() -> bool:
        state = await pool.fetchval(
            "SELECT state::text FROM deliveries WHERE reminder_id = $1", reminder_id
        )
        return state == "delivered"

    await rs.wait_for(sent, 30, f"{reminder_id} delivered")


async def _end_grace(pool: asyncpg.Pool) -> None:
    """The grace has passed: the database's clock is the one the expiry is read with, so
    the expiry is moved to its present rather than the test waiting for it."""
    await pool.execute(
        "UPDATE destination_secrets SET expires_at = now() WHERE expires_at > now()"
    )


async def test_rotation_old_secret_verifies_until_the_grace_ends_new_one_throughout(
    keyed: Settings, pool: asyncpg.Pool, receivers: list[Receiver]
) -> None:
    receiver = receivers[0]
    url = receiver.url()
    await add(keyed, url)
    [old] = await revealed(keyed, url)
    async with rs.consumer_in_process(keyed):
        await _send_one(keyed, pool, "before", url)
        rotated = await rs.relay(keyed, "destinations", "rotate-secret", url, "--grace", "1h")
        assert rotated.code == 0, rotated.stderr
        new, still_old = await revealed(keyed, url)  # newest first
        assert still_old == old and new != old
        await _send_one(keyed, pool, "during", url)
        await _end_grace(pool)
        assert await revealed(keyed, url) == [new]
        await _send_one(keyed, pool, "after", url)

    before, during, after = receiver.requests
    assert (verifies(old, before), verifies(new, before)) == (True, False)
    assert (verifies(old, during), verifies(new, during)) == (True, True)
    assert (verifies(old, after), verifies(new, after)) == (False, True)
    shown = json.loads((await rs.relay(keyed, "destinations", "show", url, "--json")).stdout)
    assert [s["valid"] for s in shown["secrets"]] == [True, False]


async def test_the_path_off_the_shared_secret_is_a_rotation_with_a_grace(
    keyed: Settings, pool: asyncpg.Pool, receivers: list[Receiver]
) -> None:
    """A destination registered without a secret of its own (no key configured, or from
    before the registry) is signed with RELAY_WEBHOOK_SIGNING_SECRETS; its first rotation
    keeps the shared secret for the grace only."""
    receiver = receivers[0]
    url = receiver.url()
    await rs.load(pool, [rs.line("legacy", url, due_at=datetime(2999, 1, 1, tzinfo=UTC))])
    assert await pool.fetchval("SELECT count(*) FROM destination_secrets") == 0
    async with rs.consumer_in_process(keyed):
        await _send_one(keyed, pool, "shared", url)
        rotated = await rs.relay(keyed, "destinations", "rotate-secret", url, "--grace", "7d")
        assert rotated.code == 0, rotated.stderr
        new, shared = await revealed(keyed, url)
        assert shared == SECRET
        await _send_one(keyed, pool, "during", url)
        await _end_grace(pool)
        await _send_one(keyed, pool, "after", url)

    first, during, after = receiver.requests
    assert (verifies(SECRET, first), verifies(new, first)) == (True, False)
    assert (verifies(SECRET, during), verifies(new, during)) == (True, True)
    assert (verifies(SECRET, after), verifies(new, after)) == (False, True)


async def test_the_envelope_is_sent_only_to_destinations_that_chose_it(
    keyed: Settings, pool: asyncpg.Pool, receivers: list[Receiver]
) -> None:
    enveloped, plain = receivers
    await add(keyed, enveloped.url(), "--envelope")
    [secret] = await revealed(keyed, enveloped.url())
    await rs.load(
        pool,
        [
            rs.line("typed", enveloped.url(), event_type="report.daily"),
            rs.line("untyped", enveloped.url()),
            rs.line("plain", plain.url(), event_type="report.daily"),
        ],
    )
    assert (await rs.relay(keyed, "publish")).code == 0
    async with rs.consumer_in_process(keyed):
        await rs.wait_for(lambda: delivered(pool, 3), 30, "3 delivered")
    occurred = {
        r["reminder_id"]: r["occurrence_at"]
        for r in await pool.fetch("SELECT reminder_id, occurrence_at FROM deliveries")
    }

    bodies = {}
    for request in enveloped.requests:
        assert verifies(secret, request)  # the signature covers the envelope as sent
        assert request.headers["webhook-schema-version"] == "1"
        body = json.loads(request.body)
        assert set(body) == {"type", "timestamp", "data"}
        bodies[body["data"]["text"]] = body
    assert bodies["hello typed"]["type"] == "report.daily"
    assert bodies["hello untyped"]["type"] == "reminder.due"
    for reminder_id in ("typed", "untyped"):
        stamp = datetime.fromisoformat(bodies[f"hello {reminder_id}"]["timestamp"])
        assert stamp == occurred[reminder_id]  # the occurrence's time, not the send's
    [raw] = plain.requests
    assert json.loads(raw.body) == {"text": "hello plain"}  # off: the payload as before
    assert "webhook-schema-version" not in {k.lower() for k in raw.headers}

    off = await rs.relay(keyed, "destinations", "envelope", enveloped.url(), "off", "--json")
    assert off.code == 0 and json.loads(off.stdout)["envelope"] is False
    async with pool.acquire() as conn, conn.transaction():
        await outbox.add_intent(
            conn, key="after-off", channel="webhook", destination=enveloped.url(),
            payload={"text": "raw again"}, allow_networks=rs.LOOPBACK, event_type="x.y",
        )  # fmt: skip
    assert (await rs.relay(keyed, "publish")).code == 0
    async with rs.consumer_in_process(keyed):
        await rs.wait_for(lambda: delivered(pool, 4), 30, "the intent delivered")
    assert json.loads(enveloped.requests[-1].body) == {"text": "raw again"}


@pytest.mark.timeout(180)
async def test_no_secret_or_key_ever_reaches_a_log(
    keyed: Settings, pool: asyncpg.Pool, receivers: list[Receiver], tmp_path: Path
) -> None:
    """A canary run at DEBUG: destinations added, secrets revealed and rotated, reminders
    loaded and published, a consumer delivering (accepted, failed and retried, disabled by
    a streak, enabled again), a bad key refused. Every secret, its key material, the
    encryption key and the encrypted tokens are looked for in every log line and stderr."""
    ok, flaky = receivers
    settings = keyed.model_copy(
        update={"destination_failure_streak": 2, "destination_failure_span_seconds": 0.0,
                "destination_hold_seconds": 1.0, "breaker_failure_threshold": 1000,
                "max_attempts": 20}
    )  # fmt: skip
    stderr: list[str] = []

    async def relay(*args: str, stdin: str | None = None, **env: str) -> rs.Result:
        result = await rs.relay(settings, *args, stdin=stdin, LOG_LEVEL="DEBUG", **env)
        stderr.append(result.stderr)
        return result

    for receiver in receivers:
        assert (await relay("destinations", "add", receiver.url(), "--envelope")).code == 0
        rotated = await relay("destinations", "rotate-secret", receiver.url(), "--grace", "1h")
        assert rotated.code == 0
    flaky.status = 503
    lines = [rs.line(f"ok{i}", ok.url()) for i in range(5)]
    lines += [rs.line(f"flaky{i}", flaky.url()) for i in range(3)]
    assert (await relay("reminders", "load", "-", stdin="\n".join(lines) + "\n")).code == 0
    assert (await relay("publish")).code == 0
    log = tmp_path / "consumer.log"
    consumer = await rs.start_consumer(settings, log, LOG_LEVEL="DEBUG")
    try:
        await rs.wait_for(lambda: rs.logged(log, "destination_disabled"), 60, "a streak")
        flaky.status = 200
        assert (await relay("destinations", "enable", flaky.url())).code == 0
        await rs.wait_for(lambda: delivered(pool, 8), 60, "all delivered")
        assert await rs.stop(consumer) == 0
    finally:
        if consumer.returncode is None:
            consumer.kill()
            await consumer.wait()
    bad_key = "canary-key-material-0123456789"
    refused = await relay("destinations", "list", DESTINATION_SECRETS_KEYS=bad_key)
    assert refused.code == 2 and "RELAY_DESTINATION_SECRETS_KEYS" in refused.stderr

    secrets = [s for r in receivers for s in await revealed(settings, r.url())]
    assert len(secrets) == 4
    tokens = [r["encrypted"] for r in await pool.fetch("SELECT encrypted FROM destination_secrets")]
    key = settings.destination_secrets_keys[0].get_secret_value()
    canaries = [*secrets, *(s.removeprefix("whsec_") for s in secrets), SECRET, key, bad_key]
    canaries += [*tokens, "whsec_", "gAAAAA"]  # any secret's prefix, any Fernet token's
    everything = "\n".join(stderr) + "\n" + log.read_text()
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    seen = {(r["level"], r["event"]) for r in logged}  # the run was logged, at DEBUG
    assert {("DEBUG", "attempt"), ("INFO", "attempt"), ("WARNING", "destination_disabled"),
            ("INFO", "deferred")} <= seen  # fmt: skip
    assert [c[:12] for c in canaries if c in everything] == []
