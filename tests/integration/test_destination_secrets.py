"""Destination secrets and options against real servers: rotation with a grace, the path
off the shared secret, the event envelope, and no secret in any log (a canary run)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from service import outbox
from service.settings import Settings
from tests.conftest import SECRET
from tests.support import relay as rs
from tests.support.receivers import Receiver, add, delivered, keyed, receivers, revealed, verifies

__all__ = ["keyed", "receivers"]  # fixtures


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
    await pool.execute("UPDATE destination_secrets SET expires_at = now() WHERE expires_at > now()")


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
        enabled = await relay("destinations", "enable", flaky.url(), "--reason", "ok", "--apply")
        assert enabled.code == 0
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
    assert {("DEBUG", "attempt"), ("INFO", "attempt"), ("WARNING", "destination_disabled")} <= seen
    assert [c[:12] for c in canaries if c in everything] == []


async def test_the_encryption_key_is_rotated_without_changing_any_secret(
    keyed: Settings, receivers: list[Receiver]
) -> None:
    from cryptography.fernet import Fernet
    from pydantic import SecretStr

    for receiver in receivers:
        await add(keyed, receiver.url())
    before = [await revealed(keyed, r.url()) for r in receivers]
    old = keyed.destination_secrets_keys[0]
    new = SecretStr(Fernet.generate_key().decode())
    both = keyed.model_copy(update={"destination_secrets_keys": [new, old]})
    rekeyed = await rs.relay(both, "destinations", "rekey", "--json")
    assert rekeyed.code == 0, rekeyed.stderr
    assert json.loads(rekeyed.stdout) == {"reencrypted": 2}
    only_new = keyed.model_copy(update={"destination_secrets_keys": [new]})
    assert [await revealed(only_new, r.url()) for r in receivers] == before
    stale = await rs.relay(keyed, "destinations", "show", receivers[0].url(), "--reveal-secret")
    assert stale.code == 2 and "RELAY_DESTINATION_SECRETS_KEYS" in stale.stderr
