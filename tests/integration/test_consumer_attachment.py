"""A consumer whose lane queue was deleted and declared again at once gets its messages.

RabbitMQ 3.10 sent no ``basic.cancel`` for a deleted quorum queue whose namesake was
declared right after (a publish run declares the topology on every run): the broker went
on counting the old consumer on the new queue and handed it the new messages, which
never reached it. The overdue sweep notices that its copies are not consumed either and
ends the session; the next one consumes again (consumer/overdue.py)."""

from __future__ import annotations

import json
from pathlib import Path

import aio_pika
import asyncpg

from service import amqp
from service.settings import Settings
from tests.support import relay as rs
from tests.support.relay import RunningPartner

ROWS = 5


def _events(log: str, event: str) -> list[dict[str, object]]:
    lines = (json.loads(t) for t in log.splitlines() if t.startswith("{"))
    return [line for line in lines if line.get("event") == event]


async def test_lane_queue_deleted_and_declared_again_at_once_is_consumed_again(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    settings = settings.model_copy(
        update={"overdue_after_seconds": 3.0, "overdue_sweep_seconds": 1.0}
    )
    topology = amqp.Topology.from_settings(settings)
    log_path = tmp_path / "consumer.log"
    assert (await rs.relay(settings, "publish")).code == 0  # declares the topology
    consumer = await rs.start_consumer(settings, log_path)
    try:

        async def consuming() -> bool:
            return bool(_events(log_path.read_text(), "consume_started"))

        await rs.wait_for(consuming, 60, "the consumer consuming")
        connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(topology.lane_queue(amqp.BULK))
            await amqp.declare(channel, topology)  # at once, as a publish run would
        await rs.load(pool, [rs.line(f"r{i}", partner.url()) for i in range(ROWS)])
        assert (await rs.relay(settings, "publish")).code == 0

        async def delivered() -> bool:
            return (await rs.states(pool)).get("delivered", 0) == ROWS

        await rs.wait_for(delivered, 90, f"all {ROWS} delivered from the queue declared again")
        log = log_path.read_text()
        # Told (basic.cancel) or not: either way a second session consumed them.
        assert len(_events(log, "consume_started")) >= 2, log[-3000:]
    finally:
        assert await rs.stop(consumer) == 0
    assert len(partner.state.accepted) == ROWS and partner.state.duplicates == 0
