"""Refreshes the values the consumer's gauges report: queue depths, ledger state counts,
the oldest claimable delivery, and the latest publish run's completion.

OpenTelemetry gauge callbacks are synchronous, so they read a ``Snapshot`` this task
refreshes every ``interval_seconds`` (one round of cheap queries), never the database
on the scrape path.
"""

from __future__ import annotations

import asyncio

import aiormq
import asyncpg
from aio_pika.abc import AbstractConnection

from service import amqp, brokers, db, ledger, logs, retention, runs
from service.gauges import Snapshot

log = logs.get("consumer")


async def sample_once(
    pool: asyncpg.Pool,
    connection: AbstractConnection,
    topology: amqp.Topology,
    snapshot: Snapshot,
) -> None:
    states = {r["state"]: r["n"] for r in await pool.fetch(db.q("overall_state_counts"))}
    snapshot.states = {state.value: states.get(state, 0) for state in ledger.State}
    found = {r["state"]: r["n"] for r in await pool.fetch(db.q("destination_state_counts"))}
    snapshot.destinations = {state: found.get(state, 0) for state in ("enabled", "disabled")}
    snapshot.oldest_claimable_seconds = float(
        await pool.fetchval(db.q("oldest_claimable_age")) or 0.0
    )
    now = await pool.fetchval(db.q("db_now"))
    # The latest run that admitted work: its completion (a minutely CronJob's empty runs say
    # nothing about it), and its lag all day long, for the dashboard and `relay status`.
    latest = await runs.reports(pool, None, 1, now, kind="publish", nonempty=True)
    if latest:
        run = latest[0]
        snapshot.latest_run_completion = run.sendable_completion_ratio
        snapshot.latest_run_age_seconds = (now - run.intended_fire_at).total_seconds()
        snapshot.latest_run_lag_seconds = run.lag_seconds
    # Any publish run, empty or not, proves the CronJob runs (RelayPublishRunsStopped), and
    # its lag says whether due work waits for a run now (RelaySchedulerLagHigh).
    newest = await runs.newest_publish_run(pool)
    if newest is not None:
        snapshot.last_publish_start = newest.started_at.timestamp()
        snapshot.last_publish_lag_seconds = newest.lag_seconds
    # Retention: the CronJob's purge is short-lived, so its facts are read from the ledger
    # here (purge_runs, purge_totals, the final rows' ages) and scraped with the rest.
    facts = await retention.facts(pool)
    snapshot.purge_last_finished = facts.last_purge_finished
    snapshot.oldest_final_seconds = facts.oldest_final_seconds
    snapshot.oldest_content_seconds = facts.oldest_content_seconds
    snapshot.purged_totals = facts.purged_totals
    channel = await connection.channel()
    try:
        depths = {}
        for name in topology.all_queues():
            depths[name] = await brokers.ready_count(channel, name)
        snapshot.queue_depth = depths
    finally:
        await channel.close()


async def run_sampler(
    pool: asyncpg.Pool,
    connection: AbstractConnection,
    topology: amqp.Topology,
    snapshot: Snapshot,
    interval_seconds: float,
) -> None:
    """Refresh forever; a failed round is logged and retried at the next interval."""
    while True:
        try:
            await sample_once(pool, connection, topology, snapshot)
        except (OSError, asyncpg.PostgresError, aiormq.exceptions.AMQPError) as exc:
            log.warning(
                "metrics sample failed",
                extra={"event": "sample_failed", "error": type(exc).__name__},
            )
        await asyncio.sleep(interval_seconds)
