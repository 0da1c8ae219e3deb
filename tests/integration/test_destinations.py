"""The destinations registry against real PostgreSQL, RabbitMQ and HTTP servers: each
partner's own secret, registration on first use, the commands' output, and auto-disable
on a failure streak with held deliveries."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import asyncpg
import pytest

from service import destinations, outbox
from service.settings import Settings
from tests.conftest import SECRET
from tests.support import relay as rs
from tests.support.receivers import Receiver, add, delivered, keyed, receivers, revealed, verifies

__all__ = ["keyed", "receivers"]  # fixtures


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
    logger.setLevel(logging.DEBUG)  # every deferral: one a minute per reason is at INFO
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


STREAK = {
    "destination_failure_streak": 3,
    "destination_failure_span_seconds": 0.5,
    "destination_hold_seconds": 1.0,
    "max_attempts": 50,  # the streak, not the attempt budget, must stop the sends
    # The circuit breaker would defer the sends (no attempt, no streak) for its cooldown:
    # kept out of the way here, it is not what this test is about.
    "breaker_failure_threshold": 1000,
}


@pytest.mark.timeout(120)
async def test_a_failure_streak_disables_the_destination_holds_its_deliveries_then_enable_sends(
    keyed: Settings, pool: asyncpg.Pool, receivers: list[Receiver], records: Records
) -> None:
    failing, healthy = receivers
    failing.status = 503
    settings = keyed.model_copy(update=STREAK)
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
        await rs.wait_for(lambda: _more(records, rounds + 5), 30, "held deliveries looked again")
        assert len(failing.requests) == requests_when_held
        assert await pool.fetchval("SELECT count(*) FROM delivery_attempts") == attempts_when_held
        states = await rs.states(pool)
        # Held: waiting (or, for a moment, claimed and about to be parked again).
        assert states.get("dead", 0) == 0
        assert states.get("retrying", 0) + states.get("sending", 0) == 5
        assert states["delivered"] == 3  # the healthy partner is not affected
        assert consumer.metric("relay.destinations.disabled", reason="failure_streak") == 1
        [event] = records.events("destination_disabled")
        assert event.reason == "failure_streak"  # type: ignore[attr-defined]
        assert event.destination_id == shown["id"]  # type: ignore[attr-defined]

        failing.status = 200
        enabled = await rs.relay(
            settings, "destinations", "enable", failing.url(), "--reason", "fixed", "--apply",
            "--json",
        )  # fmt: skip
        assert enabled.code == 0, enabled.stderr
        # Made due now: each held row not claimed at this very moment (that one is
        # parked once more and goes out a hold later).
        assert 4 <= json.loads(enabled.stdout)["held_send"] <= 5
        await rs.wait_for(lambda: delivered(pool, 8), 30, "all delivered after enable")
        assert consumer.metric("relay.delivery.dead_letters") == 0
    assert await pool.fetchval("SELECT count(*) FROM deliveries WHERE state = 'dead'") == 0
    after = json.loads(
        (await rs.relay(settings, "destinations", "show", failing.url(), "--json")).stdout
    )
    assert (after["state"], after["failure_streak"]) == ("enabled", 0)


async def _more(records: Records, n: int) -> bool:
    return len(records.events("deferred")) >= n


async def test_an_operator_disables_and_enables_a_destination(
    keyed: Settings, receivers: list[Receiver]
) -> None:
    url = receivers[0].url()
    await add(keyed, url)
    off = await rs.relay(keyed, "destinations", "disable", url, "--reason", "migrating", "--json")
    assert off.code == 0, off.stderr
    assert json.loads(off.stdout) == {
        "url": url, "disabled": True, "changed": True, "reminders_paused": 0
    }  # fmt: skip
    again = await rs.relay(keyed, "destinations", "disable", url, "--reason", "again", "--json")
    assert json.loads(again.stdout)["changed"] is False
    shown = json.loads((await rs.relay(keyed, "destinations", "show", url, "--json")).stdout)
    assert (shown["state"], shown["disabled_reason"]) == ("disabled", "operator: migrating")
    assert shown["disabled_at"] is not None
    dry = await rs.relay(keyed, "destinations", "enable", url, "--json")
    assert dry.code == 0 and json.loads(dry.stdout)["enabled"] is False  # a dry run
    unsaid = await rs.relay(keyed, "destinations", "enable", url, "--apply")
    assert unsaid.code == 2 and "say why" in unsaid.stderr
    on = await rs.relay(keyed, "destinations", "enable", url, "--reason", "back", "--apply",
                        "--json")  # fmt: skip
    assert on.code == 0 and json.loads(on.stdout)["enabled"] is True
    assert (await rs.relay(keyed, "destinations", "enable", url)).code == 1  # not disabled
    shown = json.loads((await rs.relay(keyed, "destinations", "show", url, "--json")).stdout)
    assert [(a["action"], a["reason"]) for a in shown["actions"]] == [
        ("enable", "back"), ("disable", "migrating")
    ]  # fmt: skip
    missing = await rs.relay(keyed, "destinations", "show", receivers[1].url())
    assert missing.code == 1 and "no destination" in missing.stderr
    refused = await rs.relay(keyed, "destinations", "add", "ftp://partner.example/x")
    assert refused.code == 2
