"""What reaches Prometheus of retention: the consumer's sampler reads what `relay purge` wrote
in the ledger (the CronJob itself is gone before any scrape) and /metrics shows it: when the
last purge finished (before the first, when retention was installed: RelayPurgeNotRunning
can fire for a purge that never ran), the purge period, rows purged by table and kind, and
the age of the oldest final delivery kept, with and without its content."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aio_pika
import asyncpg
import pytest
from aio_pika.abc import AbstractConnection
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from consumer import sampler
from service import amqp, telemetry
from service.settings import Settings
from tests.support import relay as rs
from tests.support import retention as history

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
async def connection(settings: Settings) -> AsyncIterator[AbstractConnection]:
    conn = await aio_pika.connect(settings.amqp_url.get_secret_value())
    channel = await conn.channel()
    await amqp.declare(channel, amqp.Topology.from_settings(settings))
    await channel.close()
    yield conn
    await conn.close()


async def _scrape(
    pool: asyncpg.Pool, connection: AbstractConnection, settings: Settings
) -> Samples:
    """One round of the consumer's sampler, then /metrics as Prometheus reads it."""
    registry = CollectorRegistry(auto_describe=True)
    telem = telemetry.setup("relay-consume", [PrometheusMetricReader(registry=registry)], {})
    try:
        snapshot = telem.metrics.snapshot
        snapshot.purge_period_seconds = settings.retention_purge_period_hours * 3600
        await sampler.sample_once(pool, connection, amqp.Topology.from_settings(settings), snapshot)
        text = generate_latest(registry).decode()
    finally:
        telem.shutdown()
    wanted = ("relay_purge_", "relay_retention_")
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if not k.startswith("otel"))))
        : s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(wanted)
    }  # fmt: skip


async def test_the_consumer_exports_what_the_purges_wrote_in_the_ledger(
    settings: Settings, pool: asyncpg.Pool, connection: AbstractConnection
) -> None:
    installed = await pool.fetchval("SELECT installed_at FROM retention_horizon")
    await history.seed(pool)
    before = await _scrape(pool, connection, settings)
    assert before[("relay_purge_last_run_timestamp_seconds", ())] == installed.timestamp()
    assert before[("relay_purge_period_seconds", ())] == 86400
    assert not [name for name, _ in before if name == "relay_purge_rows_total"]
    # Every channel has a final delivery older than its row period before the purge.
    sms_before = before[("relay_retention_oldest_final_age_seconds", (("channel", "sms"),))]
    assert sms_before > 180 * 86400  # a_sms_dead: dead 200 days ago

    for _ in range(2):
        assert (await rs.relay(settings, "purge")).code == 0
    after = await _scrape(pool, connection, settings)
    finished = await pool.fetchval("SELECT max(finished_at) FROM purge_runs WHERE status = 'ok'")
    assert after[("relay_purge_last_run_timestamp_seconds", ())] == finished.timestamp()
    rows = {
        labels: value for (name, labels), value in after.items() if name == "relay_purge_rows_total"
    }
    totals = {
        (("kind", r["kind"]), ("table", r["table_name"])): r["rows"]
        for r in await pool.fetch("SELECT * FROM purge_totals")
    }
    assert rows == totals
    assert rows[(("kind", "rows"), ("table", "deliveries"))] == 7
    assert rows[(("kind", "content"), ("table", "deliveries"))] == 5
    ages = {
        dict(labels)["channel"]: value
        for (name, labels), value in after.items()
        if name == "relay_retention_oldest_final_age_seconds"
    }
    # No final SMS is left; the oldest webhook row kept is a dead one (100 days, dead rows
    # are kept 180), the oldest e-mail the evidence of a suppression in force.
    assert set(ages) == {"webhook", "email"}
    assert 99 * 86400 < ages["webhook"] < 101 * 86400
    content = {
        dict(labels)["channel"]: value
        for (name, labels), value in after.items()
        if name == "relay_retention_oldest_content_age_seconds"
    }
    assert set(content) == {"webhook"} and content["webhook"] < 11 * 86400
