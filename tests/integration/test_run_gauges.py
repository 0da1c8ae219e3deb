"""The publish-run gauges against a real ledger and broker: what RelayPublishRunsStopped and
RelaySchedulerLagHigh read (the newest run's start and lag, empty runs included) and what the
completion alert reads (the latest run that admitted work) as the consumer's sampler fills
them and /metrics shows them.

A daily 06:00 reminder and a minutely CronJob: the 06:00 run admits it, the 06:01 run admits
nothing. The empty run must move the start gauge (the CronJob runs) and leave the completion
gauges on the 06:00 run; after a late 06:00 run, an empty run on time must bring the lag the
alert reads back to on time, while the lag of the 06:00 run stays visible."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import aio_pika
import asyncpg
import pytest
from aio_pika.abc import AbstractConnection
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from consumer import sampler
from publisher import run as publish_run
from publisher.results import RunResult
from service import amqp, telemetry
from service.ops import reminders
from service.settings import Settings
from tests.support import relay as rs

DAY = datetime(2026, 3, 2, tzinfo=UTC)
START = "relay_run_last_start_timestamp_seconds"
NEWEST_LAG = "relay_run_last_start_lag_seconds"  # RelaySchedulerLagHigh reads it
WORK_LAG = "relay_run_lag_seconds"  # the latest run that admitted work: dashboard, not paging
THRESHOLD_SECONDS = 120  # RelaySchedulerLagHigh's, deploy/observability/alerts.yaml


@dataclass
class FixedClock:
    at: datetime

    def now(self) -> datetime:
        return self.at


@dataclass
class Exported:
    """The consumer's telemetry with a Prometheus reader of its own, and its snapshot."""

    telem: telemetry.Telemetry
    registry: CollectorRegistry

    def scrape(self) -> dict[str, float]:
        text = generate_latest(self.registry).decode()
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name.startswith("relay_run_")
        }


@pytest.fixture
async def exported() -> AsyncIterator[Exported]:
    registry = CollectorRegistry(auto_describe=True)
    telem = telemetry.setup("relay-consume", [PrometheusMetricReader(registry=registry)], {})
    yield Exported(telem, registry)
    telem.shutdown()


@pytest.fixture
async def connection(settings: Settings) -> AsyncIterator[AbstractConnection]:
    conn = await aio_pika.connect(settings.amqp_url.get_secret_value())
    channel = await conn.channel()
    await amqp.declare(channel, amqp.Topology.from_settings(settings))
    await channel.close()
    yield conn
    await conn.close()


async def _publish_at(settings: Settings, at: datetime) -> RunResult:
    return await publish_run.run(settings, metrics=telemetry.noop(), clock=FixedClock(at))


async def _sample(
    pool: asyncpg.Pool, connection: AbstractConnection, settings: Settings, out: Exported
) -> dict[str, float]:
    topology = amqp.Topology.from_settings(settings)
    await sampler.sample_once(pool, connection, topology, out.telem.metrics.snapshot)
    return out.scrape()


async def test_an_empty_publish_run_refreshes_the_start_gauge_not_the_completion_gauges(
    settings: Settings,
    pool: asyncpg.Pool,
    connection: AbstractConnection,
    exported: Exported,
) -> None:
    # Before any run: no start to report (absent, never 0 = "1970").
    assert START not in await _sample(pool, connection, settings, exported)

    line = rs.line("daily", "http://127.0.0.1:9/hook", daily_at="06:00", timezone="UTC")
    await reminders.load(pool, [line], rs.LOOPBACK, now=DAY.replace(hour=5))
    first = await _publish_at(settings, DAY.replace(hour=6, second=20))
    assert first.counts.created == 1
    after_first = await _sample(pool, connection, settings, exported)

    empty = await _publish_at(settings, DAY.replace(hour=6, minute=1, second=5))
    assert empty.counts.created == 0 and empty.run_id > first.run_id
    after_empty = await _sample(pool, connection, settings, exported)

    started = {
        r["id"]: r["started_at"]
        for r in await pool.fetch("SELECT id, started_at FROM publish_runs WHERE kind = 'publish'")
    }
    assert after_first[START] == pytest.approx(started[first.run_id].timestamp(), abs=1e-6)
    # The run that admitted nothing is the newest run: the gauge follows it.
    assert after_empty[START] == pytest.approx(started[empty.run_id].timestamp(), abs=1e-6)
    assert after_empty[START] >= after_first[START]
    # The completion alert's gauges still describe the 06:00 run (fire time 06:00).
    now = await pool.fetchval("SELECT now()")
    assert after_empty["relay_run_age_seconds"] == pytest.approx(
        (now - DAY.replace(hour=6)).total_seconds(), abs=60
    )
    assert after_empty["relay_run_completion_ratio"] == 0.0  # owed, not yet delivered


async def test_a_rescue_or_backfill_run_is_not_a_publish_run(
    settings: Settings,
    pool: asyncpg.Pool,
    connection: AbstractConnection,
    exported: Exported,
) -> None:
    # `relay rescue` is not the CronJob: alone it does not say publish runs happen.
    result = await publish_run.run(
        settings, metrics=telemetry.noop(), clock=FixedClock(DAY), rescue_only=True
    )
    assert await pool.fetchval("SELECT kind FROM publish_runs WHERE id = $1", result.run_id) == (
        "rescue"
    )
    assert START not in await _sample(pool, connection, settings, exported)
    await _publish_at(settings, DAY)
    publish_start = await pool.fetchval(
        "SELECT started_at FROM publish_runs WHERE kind = 'publish'"
    )
    await publish_run.run(
        settings, metrics=telemetry.noop(), clock=FixedClock(DAY), rescue_only=True
    )
    sampled = await _sample(pool, connection, settings, exported)
    assert sampled[START] == pytest.approx(publish_start.timestamp(), abs=1e-6)


async def _db_now(pool: asyncpg.Pool) -> datetime:
    now: datetime = await pool.fetchval("SELECT now()")
    return now


async def _lag(pool: asyncpg.Pool, run_id: int) -> float:
    lag: timedelta = await pool.fetchval(
        "SELECT started_at - intended_fire_at FROM publish_runs WHERE id = $1", run_id
    )
    return lag.total_seconds()


async def test_after_a_late_daily_run_an_empty_run_on_time_brings_the_alerted_lag_back(
    settings: Settings,
    pool: asyncpg.Pool,
    connection: AbstractConnection,
    exported: Exported,
) -> None:
    # Runs start on the database's clock, so this test's "06:00" is ten minutes before now:
    # the publisher did not run since, and the first run after it admits that occurrence.
    now = await _db_now(pool)
    fire = (now - timedelta(minutes=10)).replace(second=0, microsecond=0)
    line = rs.line("daily", "http://127.0.0.1:9/hook", daily_at=f"{fire:%H:%M}", timezone="UTC")
    await reminders.load(pool, [line], rs.LOOPBACK, now=fire - timedelta(hours=1))

    late = await _publish_at(settings, now)
    assert late.counts.created == 1
    late_lag = await _lag(pool, late.run_id)
    assert late_lag >= 9 * 60  # intended: the occurrence it admitted, ten minutes ago
    after_late = await _sample(pool, connection, settings, exported)
    assert after_late[NEWEST_LAG] == pytest.approx(late_lag, abs=1e-3)
    assert after_late[NEWEST_LAG] > THRESHOLD_SECONDS
    assert after_late[WORK_LAG] == pytest.approx(late_lag, abs=1e-3)

    # The next minutes' runs find nothing due: each is its own intended time.
    for _ in range(2):
        empty = await _publish_at(settings, await _db_now(pool))
        assert empty.counts.created == 0 and empty.run_id > late.run_id
        sampled = await _sample(pool, connection, settings, exported)
        empty_lag = await _lag(pool, empty.run_id)
        assert sampled[NEWEST_LAG] == pytest.approx(empty_lag, abs=1e-3)
        assert 0 <= sampled[NEWEST_LAG] < THRESHOLD_SECONDS
        # The late run itself stays visible: the lag of the latest run that admitted work.
        assert sampled[WORK_LAG] == pytest.approx(late_lag, abs=1e-3)
        started = await pool.fetchval(
            "SELECT started_at FROM publish_runs WHERE id = $1", empty.run_id
        )
        assert sampled[START] == pytest.approx(started.timestamp(), abs=1e-6)


async def test_a_run_still_catching_up_keeps_the_alerted_lag_high(
    settings: Settings,
    pool: asyncpg.Pool,
    connection: AbstractConnection,
    exported: Exported,
) -> None:
    # Runs persistently late: run after run admits an occurrence that waited minutes for it,
    # so the newest run is late each time and the gauge stays above the threshold.
    now = await _db_now(pool)
    for minutes in (12, 8):
        fire = (now - timedelta(minutes=minutes)).replace(second=0, microsecond=0)
        line = rs.line(
            f"daily-{minutes}", "http://127.0.0.1:9/hook", daily_at=f"{fire:%H:%M}", timezone="UTC"
        )
        await reminders.load(pool, [line], rs.LOOPBACK, now=fire - timedelta(hours=1))
        result = await _publish_at(settings, await _db_now(pool))
        assert result.counts.created == 1
        sampled = await _sample(pool, connection, settings, exported)
        assert sampled[NEWEST_LAG] == pytest.approx(await _lag(pool, result.run_id), abs=1e-3)
        assert sampled[NEWEST_LAG] > THRESHOLD_SECONDS
