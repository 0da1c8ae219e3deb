"""``relay consume``: the composition root of a consumer process.

Builds settings -> pool -> broker connection -> topology -> channels -> worker, serves the
health endpoints, and runs the one shutdown protocol: SIGTERM/SIGINT -> stop intake ->
drain in-flight deliveries within the grace period -> close in reverse order -> exit 0.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Mapping

import asyncpg
from aio_pika.abc import AbstractQueue
from opentelemetry import trace

from consumer import budget, health, isolation, retry, sampler, worker
from consumer.channels.base import Channel
from service import amqp, db, errors, logs, netpolicy
from service.clock import SystemClock
from service.crashpoints import CrashPoints
from service.settings import Settings
from service.telemetry import Metrics

log = logs.get("consumer")


def build_channels(settings: Settings) -> dict[str, Channel]:
    """The channel adapters this process can send through (email/SMS when configured)."""
    from consumer.channels import email, sms, webhook

    try:
        channels: dict[str, Channel] = {
            "webhook": webhook.WebhookChannel(
                webhook.WebhookConfig(
                    timeout_seconds=settings.http_timeout_seconds,
                    connect_timeout_seconds=settings.http_connect_timeout_seconds,
                    signing_secrets=tuple(
                        s.get_secret_value() for s in settings.webhook_signing_secrets
                    ),
                    allow_networks=tuple(netpolicy.parse_networks(settings.allow_networks)),
                    # Requests never queue inside the HTTP client: isolation caps each
                    # destination first, so the client's limits match it.
                    connection_limit=settings.prefetch,
                    connection_limit_per_host=destination_share(settings),
                )
            )
        }
        if settings.email_api_key.get_secret_value():
            channels["email"] = email.EmailChannel(
                email.EmailConfig(
                    api_key=settings.email_api_key,
                    sender=settings.email_sender,
                    base_url=settings.email_api_base_url,
                    timeout_seconds=settings.http_timeout_seconds,
                    connect_timeout_seconds=settings.http_connect_timeout_seconds,
                )
            )
        if settings.sms_account_sid:
            channels["sms"] = sms.SmsChannel(
                sms.SmsConfig(
                    account_sid=settings.sms_account_sid,
                    auth_token=settings.sms_auth_token,
                    from_number=settings.sms_from_number or None,
                    messaging_service_sid=settings.sms_messaging_service_sid or None,
                    base_url=settings.sms_api_base_url,
                    timeout_seconds=settings.http_timeout_seconds,
                    connect_timeout_seconds=settings.http_connect_timeout_seconds,
                )
            )
    except ValueError as exc:
        # The adapters' own checks name the field; never the secret's value.
        raise errors.ConfigError(f"channel settings: {exc}") from None
    return channels


def destination_share(settings: Settings) -> int:
    """Sends one destination may have in flight in this process."""
    return max(1, int(settings.prefetch * settings.destination_max_share))


def build_policy(settings: Settings) -> retry.RetryPolicy:
    return retry.RetryPolicy(
        base_seconds=settings.retry_base_seconds,
        multiplier=settings.retry_multiplier,
        max_seconds=settings.retry_max_seconds,
        retry_after_max_seconds=settings.retry_after_max_seconds,
        max_attempts=settings.max_attempts,
        max_attempts_by_channel=retry.parse_attempts_by_channel(settings.max_attempts_per_channel),
    )


async def run(
    settings: Settings,
    *,
    metrics: Metrics,
    render_metrics: health.MetricsRender | None = None,
    channels: Mapping[str, Channel] | None = None,
    stop: asyncio.Event | None = None,
    tracer: trace.Tracer | None = None,
) -> int:
    """Consume until SIGTERM/SIGINT (or until ``stop`` is set); return the exit code."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    broker_lost = asyncio.Event()

    channels = dict(channels) if channels is not None else build_channels(settings)
    pool = await db.create_pool(settings)
    connection = await amqp.connect(settings, name=f"relay-consume@{socket.gethostname()}")

    # Crash-only on broker loss: exit non-zero and let the orchestrator restart us;
    # unacked messages are redelivered to the other replicas meanwhile.
    def on_close(*_: object) -> None:
        broker_lost.set()
        stop.set()

    connection.close_callbacks.add(on_close)
    topology = amqp.Topology.from_settings(settings)
    consuming = False
    try:
        setup_channel = await connection.channel()
        await amqp.declare(setup_channel, topology)
        await setup_channel.close()
        publisher = await amqp.ConfirmedPublisher.open(connection, topology, settings)
        budgets = budget.Budgets(
            pool,
            budget.parse_budgets(settings.budgets),
            urgent_reserve_fraction=settings.budget_urgent_reserve,
        )
        await budgets.setup()
        work = worker.Worker(
            pool=pool,
            publisher=publisher,
            channels=channels,
            policy=build_policy(settings),
            config=worker.WorkerConfig(
                lease_seconds=settings.lease_seconds,
                write_batch_max=settings.write_batch_max,
                # Few concurrent flushes make each one bigger: fewer round trips.
                write_concurrency=max(1, min(2, settings.database_pool_size - 2)),
                budget_max_wait_seconds=settings.budget_max_wait_seconds,
                send_timeout_seconds=settings.http_timeout_seconds,
            ),
            metrics=metrics,
            clock=SystemClock(),
            crash=CrashPoints(settings.crash_at),
            guard=isolation.DestinationGuard(
                max_in_flight=destination_share(settings),
                failure_threshold=settings.breaker_failure_threshold,
                cooldown_seconds=settings.breaker_cooldown_seconds,
                max_wait_seconds=settings.destination_wait_seconds,
            ),
            budgets=budgets,
            tracer=tracer,
        )
        work.start()
        consume_channel = await connection.channel()
        await consume_channel.set_qos(prefetch_count=settings.prefetch)

        async def ready() -> tuple[bool, dict[str, bool]]:
            broker_ok = not connection.is_closed and not consume_channel.is_closed
            try:
                await pool.fetchval(db.q("db_now"))
                db_ok = True
            except (OSError, asyncpg.PostgresError):
                db_ok = False
            return broker_ok and db_ok and consuming, {
                "broker": broker_ok,
                "database": db_ok,
                "consuming": consuming,
            }

        runner = None
        if settings.health_port:
            runner = await health.serve(
                health.build_app(ready, render_metrics), settings.health_host, settings.health_port
            )
        queues: list[tuple[AbstractQueue, str]] = []
        # Urgent lane first, so a bulk backlog never sits in front of it on this channel.
        for lane in (amqp.URGENT, amqp.BULK):
            queue = await consume_channel.get_queue(topology.lane_queue(lane), ensure=False)
            tag = await queue.consume(work.on_message)
            queues.append((queue, tag))
        consuming = True
        metrics.snapshot.ready = True
        sampler_task = asyncio.create_task(
            sampler.run_sampler(
                pool, connection, topology, metrics.snapshot, settings.metrics_sample_seconds
            )
        )
        log.info("consuming", extra={"event": "consume_started", "prefetch": settings.prefetch})

        await stop.wait()
        sampler_task.cancel()
        metrics.snapshot.ready = False
        if broker_lost.is_set():
            log.error("broker connection lost", extra={"event": "broker_lost"})
            await work.close()
            return errors.ExitCode.UNAVAILABLE

        # Stop intake first; prefetched but unstarted messages are redelivered on close.
        consuming = False
        for queue, tag in queues:
            await queue.cancel(tag)
        drained = await work.drain(settings.shutdown_grace_seconds)
        log.info(
            "consumer stopping",
            extra={"event": "consume_stopping", "drained": drained, "left": work.in_flight},
        )
        await work.close()
        await publisher.close()
        await consume_channel.close()
        if runner is not None:
            await runner.cleanup()
        return errors.ExitCode.OK
    finally:
        for ch in channels.values():
            await ch.close()
        await connection.close()
        await pool.close()


async def check(settings: Settings) -> int:
    """``relay consume --check``: exit 0 if the database and the broker answer."""
    try:
        pool = await db.create_pool(settings, size=1)
        try:
            await pool.fetchval(db.q("db_now"))
        finally:
            await pool.close()
        connection = await amqp.connect(settings, name="relay-check")
        await connection.close()
    except errors.UnavailableError as exc:
        print(f"not ready: {exc}")
        return errors.ExitCode.UNAVAILABLE
    print("ok: database and broker reachable")
    return errors.ExitCode.OK
