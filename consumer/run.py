"""``relay consume``: the composition root of a consumer process.

Builds settings -> channels -> pool -> broker connection, topology and publisher ->
database watch -> budgets -> store, gate, deliverer, worker -> consume channel -> health
endpoints -> sampler, each registered on one ``AsyncExitStack`` so every exit path closes
what was opened, in reverse order, within a deadline.

One shutdown protocol for every cause: SIGTERM/SIGINT (exit 0); the broker connection, the
consume channel or the publisher channel closed, the consumer cancelled by the broker, a
publish not confirmed, or the database unreachable past its bound (exit 3, and the
orchestrator restarts the pod). Stop intake -> give back claims that cannot finish ->
await requests already sent -> close. It always ends within the shutdown grace period
plus a few seconds, whatever the servers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator, Mapping
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractQueue
from opentelemetry import trace

from consumer import budget, delivery, gate, health, isolation, retry, sampler, store, worker
from consumer.channels.base import Channel
from consumer.outage import DatabaseWatch
from service import amqp, db, errors, logs, netpolicy
from service.clock import SystemClock
from service.crashpoints import CrashPoints
from service.settings import Settings
from service.telemetry import Metrics

log = logs.get("consumer")

# Past the grace period, each closing step gets at most this long.
_CLOSE_STEP_SECONDS = 2.0


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


class Failure:
    """Why the process must stop and exit 3 (first cause wins); sets ``stop``."""

    def __init__(self, stop: asyncio.Event) -> None:
        self._stop = stop
        self.reason: str | None = None
        self.closing = False  # our own close also closes channels: not a failure

    def fail(self, reason: str) -> None:
        if self.closing:
            return
        if self.reason is None:
            self.reason = reason
            log.error(
                "stopping: server failure", extra={"event": "server_failure", "reason": reason}
            )
        self._stop.set()

    @property
    def exit_code(self) -> int:
        return errors.ExitCode.OK if self.reason is None else errors.ExitCode.UNAVAILABLE


@contextlib.contextmanager
def _signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGTERM/SIGINT set ``stop``; the previous handlers come back on exit."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _bounded(step: Any, seconds: float) -> None:
    """Run one closing step; past its deadline it is abandoned (the process is ending)."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(max(seconds, 0.1)):
            await step


async def _cancel_task(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


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
    async with contextlib.AsyncExitStack() as stack:
        if stop is None:
            stop = asyncio.Event()
            stack.enter_context(_signals(stop))
        failure = Failure(stop)
        op_timeout = settings.amqp_timeout_seconds

        adapters = dict(channels) if channels is not None else build_channels(settings)
        for adapter in adapters.values():
            stack.push_async_callback(_bounded, adapter.close(), _CLOSE_STEP_SECONDS)

        pool = await db.create_pool(settings)
        stack.push_async_callback(db.close_pool, pool, _CLOSE_STEP_SECONDS)

        connection, publisher = await amqp.open_publisher(settings, "relay-consume")
        stack.push_async_callback(amqp.close_connection, connection, _CLOSE_STEP_SECONDS)
        # Crash-only on broker trouble: exit 3 and let the orchestrator restart us on a
        # fresh connection; unacked messages go back to the other replicas meanwhile.
        connection.close_callbacks.add(lambda *_: failure.fail("broker connection lost"))
        publisher.channel.close_callbacks.add(lambda *_: failure.fail("publisher channel closed"))
        stack.callback(setattr, failure, "closing", True)  # runs before the close above

        watch = DatabaseWatch(
            pool,
            outage_max_seconds=settings.database_outage_max_seconds,
            probe_timeout_seconds=settings.database_command_timeout_seconds,
            on_give_up=lambda: failure.fail("database unreachable"),
        )
        stack.push_async_callback(watch.stop)

        budgets = budget.Budgets(
            pool,
            budget.parse_budgets(settings.budgets),
            urgent_reserve_fraction=settings.budget_urgent_reserve,
        )
        await budgets.setup()

        stopping = asyncio.Event()
        ledger_store = store.Store(
            pool,
            watch,
            lease_seconds=settings.lease_seconds,
            batch_max=settings.write_batch_max,
            # Few concurrent flushes make each one bigger: fewer round trips.
            concurrency=max(1, min(2, settings.database_pool_size - 2)),
            stopping=stopping,
        )
        ledger_store.start()
        work = worker.Worker(
            store=ledger_store,
            deliverer=delivery.Deliverer(
                store=ledger_store,
                gate=gate.Gate(
                    guard=isolation.DestinationGuard(
                        max_in_flight=destination_share(settings),
                        failure_threshold=settings.breaker_failure_threshold,
                        cooldown_seconds=settings.breaker_cooldown_seconds,
                        max_wait_seconds=settings.destination_wait_seconds,
                    ),
                    budgets=budgets,
                    metrics=metrics,
                    lease_seconds=settings.lease_seconds,
                    send_timeout_seconds=settings.http_timeout_seconds,
                    budget_max_wait_seconds=settings.budget_max_wait_seconds,
                ),
                channels=adapters,
                policy=build_policy(settings),
                metrics=metrics,
                clock=SystemClock(),
                budgets_pause=budgets.pause,
                crash=CrashPoints(settings.crash_at),
            ),
            publisher=publisher,
            config=worker.WorkerConfig(send_timeout_seconds=settings.http_timeout_seconds),
            metrics=metrics,
            stopping=stopping,
            on_broker_failure=lambda: failure.fail("publish not confirmed"),
            crash=CrashPoints(settings.crash_at),
            tracer=tracer,
        )

        async with asyncio.timeout(op_timeout):
            consume_channel = await connection.channel()
            await consume_channel.set_qos(prefetch_count=settings.prefetch)
            topology = amqp.Topology.from_settings(settings)
            # Urgent lane first, so a bulk backlog never sits in front of it.
            queues = [
                await consume_channel.get_queue(topology.lane_queue(lane), ensure=False)
                for lane in (amqp.URGENT, amqp.BULK)
            ]
        consume_channel.close_callbacks.add(lambda *_: failure.fail("consume channel closed"))
        underlay = await consume_channel.get_underlay_channel()
        underlay.on_consumer_cancel_callbacks.add(
            lambda *_: failure.fail("consumer cancelled by the broker")
        )

        consuming = False

        async def ready() -> tuple[bool, dict[str, bool]]:
            broker_ok = not (connection.is_closed or consume_channel.is_closed or publisher.closed)
            db_ok = await watch.check()
            return broker_ok and db_ok and consuming, {
                "broker": broker_ok,
                "database": db_ok,
                "consuming": consuming,
            }

        def live() -> tuple[bool, dict[str, float]]:
            outage = watch.outage_seconds
            stalled = work.stalled_for()
            ok = outage <= settings.database_outage_max_seconds and (
                stalled <= settings.liveness_stall_seconds
            )
            return ok, {
                "database_outage_seconds": round(outage, 3),
                "stalled_seconds": round(stalled, 3),
            }

        if settings.health_port:
            runner = await health.serve(
                health.build_app(ready, live, render_metrics),
                settings.health_host,
                settings.health_port,
            )
            stack.push_async_callback(_bounded, runner.cleanup(), _CLOSE_STEP_SECONDS)

        async with asyncio.timeout(op_timeout):
            tags = [(queue, await queue.consume(work.on_message)) for queue in queues]
        consuming = True
        metrics.snapshot.ready = True
        sampler_task = asyncio.create_task(
            sampler.run_sampler(
                pool, connection, topology, metrics.snapshot, settings.metrics_sample_seconds
            )
        )
        stack.push_async_callback(_cancel_task, sampler_task)
        log.info("consuming", extra={"event": "consume_started", "prefetch": settings.prefetch})

        await stop.wait()
        consuming = False
        metrics.snapshot.ready = False
        await _shutdown(settings, work, watch, consume_channel, tags, failure)
        return failure.exit_code
    raise AssertionError("unreachable")  # the exit stack never swallows an exception


async def _shutdown(
    settings: Settings,
    work: worker.Worker,
    watch: DatabaseWatch,
    consume_channel: AbstractChannel,
    tags: list[tuple[AbstractQueue, str]],
    failure: Failure,
) -> None:
    """Stop intake, give back what cannot finish, await what was sent; all within grace."""
    started = time.monotonic()
    grace_end = started + settings.shutdown_grace_seconds
    work.stop_intake(grace_ends_at=grace_end)
    if failure.reason is not None:
        work.give_back_now()  # a server failed: waiting for budget or slots is pointless
    if not consume_channel.is_closed:
        for queue, tag in tags:
            await _bounded(queue.cancel(tag), _CLOSE_STEP_SECONDS)
    # Requests on the wire finish (HTTP timeout < grace); claims that could not start
    # are released and handed back before the end of grace.
    drained = await work.drain(grace_end - 1.0)
    watch.close()  # statements still waiting out an outage give up: their work goes back
    drained = await work.drain(grace_end) or drained
    log.info(
        "consumer stopping",
        extra={
            "event": "consume_stopping",
            "drained": drained,
            "left": work.in_flight,
            "reason": failure.reason or "signal",
        },
    )
    await work.close(_CLOSE_STEP_SECONDS)


async def check(settings: Settings) -> int:
    """``relay consume --check``: exit 0 if the database and the broker answer."""
    try:
        pool = await db.create_pool(settings, size=1)
        try:
            await pool.fetchval(db.q("db_now"))
        finally:
            await db.close_pool(pool, _CLOSE_STEP_SECONDS)
        connection = await amqp.connect(settings, name="relay-check")
        await amqp.close_connection(connection, _CLOSE_STEP_SECONDS)
    except errors.UnavailableError as exc:
        print(f"not ready: {exc}")
        return errors.ExitCode.UNAVAILABLE
    print("ok: database and broker reachable")
    return errors.ExitCode.OK
