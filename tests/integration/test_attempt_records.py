"""What each attempt row tells support work: outcome, status, and whether the request may
have reached the receiver. Real PostgreSQL, RabbitMQ and HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncpg
import pytest

from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import nodes
from tests.support import relay as rs
from tests.support.relay import RunningPartner

pytestmark = pytest.mark.timeout(60)


async def test_an_answered_failure_may_have_been_delivered_a_refused_connection_not(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    partner.state.rules["flaky"] = partner_mod.PathRule(status=503, first_n=1)
    closed_port = nodes.free_port()  # nothing listens there: the connection is refused
    await rs.load(
        pool,
        [
            rs.line("answered", partner.url("flaky")),
            rs.line("refused", f"http://127.0.0.1:{closed_port}/hooks/x"),
        ],
    )
    assert (await rs.relay(settings, "publish")).code == 0
    one_attempt = settings.model_copy(update={"max_attempts": 1})

    async def both_dead() -> bool:
        return (await rs.states(pool)) == {"dead": 2}

    async with rs.consumer_in_process(one_attempt):
        await rs.wait_for(both_dead, 30, "both attempted once, out of attempts")
    rows = await pool.fetch(
        "SELECT d.reminder_id, a.outcome, a.http_status, a.possibly_delivered"
        " FROM delivery_attempts AS a JOIN deliveries AS d ON d.id = a.delivery_id"
        " ORDER BY d.reminder_id, a.attempt"
    )
    assert [tuple(r.values()) for r in rows] == [
        ("answered", "retry", 503, True),
        ("refused", "retry", None, False),
    ]
