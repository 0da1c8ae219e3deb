"""A replica without a channel's configuration defers its deliveries, never kills them.

One pod without the e-mail key mounted must not dead-letter the e-mails it happens to
receive: it gives each back without an attempt, and a replica that has the key sends it.
Real PostgreSQL, RabbitMQ and a Resend-shaped HTTP API on 127.0.0.1.
"""

from __future__ import annotations

import asyncpg
import pytest
from pydantic import SecretStr

from service import outbox
from service.settings import Settings
from tests.support import relay as rs
from tests.support.email_api import API_KEY, SENDER, serve_email_api

pytestmark = pytest.mark.timeout(90)


async def test_email_on_a_replica_without_the_email_key_is_deferred_then_sent_by_one_with_it(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await outbox.add_intent(
            conn,
            key="order-7:shipped:email",
            channel="email",
            destination="customer@example.com",
            payload={"subject": "Shipped", "text": "On its way"},
        )
    assert (await rs.relay(settings, "publish")).code == 0

    async def deferred_once() -> bool:
        return bool(await pool.fetchval("SELECT state = 'retrying' FROM deliveries"))

    # No e-mail key on this replica: the channel is missing.
    async with rs.consumer_in_process(settings) as consumer:
        await rs.wait_for(deferred_once, 30, "the e-mail deferred by the replica without it")
        deferrals = consumer.metric("relay.delivery.deferrals", reason="channel_not_configured")
    row = await pool.fetchrow("SELECT state::text, attempts, last_error FROM deliveries")
    assert row is not None
    assert (row["state"], row["attempts"], row["last_error"]) == ("retrying", 0, None)
    assert await pool.fetchval("SELECT count(*) FROM delivery_attempts") == 0
    assert deferrals >= 1

    async with serve_email_api() as api:
        with_email = settings.model_copy(
            update={
                "email_api_key": SecretStr(API_KEY),
                "email_sender": SENDER,
                "email_api_base_url": f"http://127.0.0.1:{api.port}",
            }
        )

        async def delivered() -> bool:  # accepted: this provider sends no receipts
            return (await rs.states(pool)) == {"accepted": 1}

        # The deferred copy waits out its 30 s delay; rescue-free, a replica with the key
        # takes it when it comes back.
        async with rs.consumer_in_process(with_email):
            await rs.wait_for(delivered, 60, "the e-mail sent by a replica with the key")
        assert api.requests == {"outbox:order-7:shipped:email": 1}
    row = await pool.fetchrow("SELECT attempts FROM deliveries")
    assert row is not None and row["attempts"] == 1
