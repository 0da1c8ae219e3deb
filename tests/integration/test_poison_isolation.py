"""One bad message harms no other: poison published together with good deliveries is
dead-lettered on first sight with its reason, every good one is delivered, and the
consumer process keeps running without a traceback. Real consumer process and servers.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import asyncpg
import pytest

from service import amqp, messages
from service.settings import Settings
from tests.support import broker
from tests.support import relay as rs
from tests.support.relay import RunningPartner

# (body, the reason its dead letter must carry)
POISON: list[tuple[bytes, str]] = [
    (b'{"v": 1, "delivery_id": 9223372036854775808}', "invalid message: bad field(s) delivery_id"),
    (b"[" * 100_000 + b"]" * 100_000, "oversized body"),
    (b"this is not JSON {", "undecodable body"),
    (b'{"v": 1, "delivery_id": 1, "pad": "' + b"x" * 4000 + b'"}', "oversized body"),
    (b"[" * 1000, "undecodable body"),  # deep enough to overflow the JSON parser
    (b'{"v": 1, "delivery_id": 987654321}', "unknown delivery id"),  # claimed in a group
]


def _log_entries(log: Path) -> tuple[list[dict[str, object]], list[str]]:
    entries, raw = [], []
    for text in log.read_text().splitlines():
        try:
            entries.append(json.loads(text))
        except ValueError:
            raw.append(text)
    return entries, raw


@pytest.mark.timeout(180)
async def test_poison_among_good_deliveries_is_dead_lettered_alone_and_the_rest_delivered(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    await rs.load(pool, [rs.line(f"g{i}", partner.url("good")) for i in range(30)])
    await broker.declare(settings)
    # Poison before, good in the middle, poison after: all in one consumer's prefetch.
    await broker.publish_raw(settings, [body for body, _ in POISON[:3]])
    assert (await rs.relay(settings, "publish")).code == 0
    await broker.publish_raw(settings, [body for body, _ in POISON[3:]])
    assert (await rs.states(pool)) == {"queued": 30}

    log = tmp_path / "consumer.log"
    consumer = await rs.start_consumer(settings, log)
    try:

        async def settled() -> bool:
            delivered = (await rs.states(pool)).get("delivered", 0)
            return delivered == 30 and await broker.dead_count(settings) == len(POISON)

        await rs.wait_for(settled, 90, "30 delivered and every poison dead-lettered", 0.2)
        assert consumer.returncode is None, "the consumer process died"
        dead = await broker.read(settings, broker.topology(settings).dead_queue, remove=True)
        consumer.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(consumer.wait(), 30)
    finally:
        if consumer.returncode is None:
            consumer.kill()
            await consumer.wait()
    assert code == 0

    # Exactly the poison, each once, each with its reason from the consumer (not the
    # broker's delivery limit), and no good delivery among them.
    assert sorted(m.body for m in dead) == sorted(body for body, _ in POISON)
    for message in dead:
        expected = dict(POISON)[message.body]
        assert str(message.headers[amqp.REASON_HEADER]).startswith(expected), message.headers
        assert "x-first-death-reason" not in (message.headers or {})
    good_ids = {r["id"] for r in await pool.fetch("SELECT id FROM deliveries")}
    for message in dead:
        try:
            assert messages.decode(message.body).delivery_id not in good_ids
        except messages.MessageError:
            pass
    rows = await pool.fetch("SELECT state::text AS state, attempts FROM deliveries")
    assert {(r["state"], r["attempts"]) for r in rows} == {("delivered", 1)}
    assert partner.state.logical_events == 30 and partner.state.duplicates == 0

    entries, raw = _log_entries(log)
    assert raw == [], f"non-JSON lines (a traceback?) in the consumer's log: {raw[:5]}"
    poison_lines = [e for e in entries if e.get("event") == "poison"]
    assert len(poison_lines) == len(POISON)  # first sight, once each: never redelivered
    assert [e for e in entries if e.get("level") in ("ERROR", "CRITICAL") or "exc_info" in e] == []
