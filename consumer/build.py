"""Builders of the consumer's parts from settings, for its composition root (run.py).

Nothing here opens a connection: the root opens the servers and hands them in.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import Any

import asyncpg
from aio_pika.abc import AbstractConnection
from opentelemetry import trace

from consumer import (
    budget,
    delivery,
    gate,
    isolation,
    overdue,
    reconcile,
    registry,
    retry,
    settle,
    store,
    worker,
)
from consumer.acks import GroupedAcks
from consumer.channels.base import Channel
from consumer.outage import DatabaseWatch
from service import amqp, brokers, destinations, errors, netpolicy, publishing
from service.clock import SystemClock
from service.crashpoints import CrashPoints
from service.settings import Settings
from service.telemetry import Metrics


def channels(settings: Settings) -> dict[str, Channel]:
    """The channel adapters this process can send through (email/SMS when configured).

    A bad channel setting raises ConfigError naming the RELAY_* variable (never a
    secret's value).
    """
    try:
        allow_networks = tuple(netpolicy.parse_networks(settings.allow_networks))
    except ValueError as exc:
        raise errors.ConfigError(f"RELAY_ALLOW_NETWORKS: {exc}") from None
    with _naming(_WEBHOOK_SETTINGS, "the webhook channel"):
        channels: dict[str, Channel] = {"webhook": _webhook(settings, allow_networks)}
    if settings.email_api_key.get_secret_value():
        with _naming(_EMAIL_SETTINGS, "the e-mail channel is on: RELAY_EMAIL_API_KEY is set"):
            channels["email"] = _email(settings)
    if settings.sms_account_sid:
        with _naming(_SMS_SETTINGS, "the SMS channel is on: RELAY_SMS_ACCOUNT_SID is set"):
            channels["sms"] = _sms(settings)
    return channels


def _webhook(settings: Settings, allow_networks: tuple[netpolicy.IPNetwork, ...]) -> Channel:
    from consumer.channels import webhook

    return webhook.WebhookChannel(
        webhook.WebhookConfig(
            timeout_seconds=settings.http_timeout_seconds,
            connect_timeout_seconds=settings.http_connect_timeout_seconds,
            signing_secrets=tuple(s.get_secret_value() for s in settings.webhook_signing_secrets),
            allow_networks=allow_networks,
            # Requests never queue inside the HTTP client: isolation caps each
            # destination first, so the client's limits match it.
            connection_limit=settings.prefetch,
            connection_limit_per_host=destination_share(settings),
        )
    )


def _email(settings: Settings) -> Channel:
    from consumer.channels import email

    return email.EmailChannel(
        email.EmailConfig(
            api_key=settings.email_api_key,
            sender=settings.email_sender,
            base_url=settings.email_api_base_url,
            timeout_seconds=settings.http_timeout_seconds,
            connect_timeout_seconds=settings.http_connect_timeout_seconds,
        )
    )


def _sms(settings: Settings) -> Channel:
    from consumer.channels import sms

    # each message asks for its status callbacks at `relay receipts`
    callbacks = settings.receipts_public_url
    return sms.SmsChannel(
        sms.SmsConfig(
            account_sid=settings.sms_account_sid,
            auth_token=settings.sms_auth_token,
            from_number=settings.sms_from_number or None,
            messaging_service_sid=settings.sms_messaging_service_sid or None,
            base_url=settings.sms_api_base_url,
            timeout_seconds=settings.http_timeout_seconds,
            connect_timeout_seconds=settings.http_connect_timeout_seconds,
            status_callback_url=f"{callbacks}/receipts/sms" if callbacks else None,
        )
    )


# An adapter config's field -> the setting it comes from, so an adapter's ValueError
# (which names its field) can name the RELAY_* variable.
_WEBHOOK_SETTINGS = {"signing_secrets": "RELAY_WEBHOOK_SIGNING_SECRETS"}
_EMAIL_SETTINGS = {
    "api_key": "RELAY_EMAIL_API_KEY",
    "sender": "RELAY_EMAIL_SENDER",
    "base_url": "RELAY_EMAIL_API_BASE_URL",
}
_SMS_SETTINGS = {
    "account_sid": "RELAY_SMS_ACCOUNT_SID",
    "auth_token": "RELAY_SMS_AUTH_TOKEN",
    "from_number": "RELAY_SMS_FROM_NUMBER",
    "messaging_service_sid": "RELAY_SMS_MESSAGING_SERVICE_SID",
    "base_url": "RELAY_SMS_API_BASE_URL",
}


@contextlib.contextmanager
def _naming(fields: Mapping[str, str], context: str) -> Iterator[None]:
    """Turn an adapter config's ValueError into ConfigError naming the setting."""
    try:
        yield
    except ValueError as exc:
        message = str(exc)
        named = [
            (match.start(), setting)
            for field, setting in fields.items()
            if (match := re.search(rf"\b{field}\b", message))
        ]
        setting = min(named)[1] if named else "channel settings"
        raise errors.ConfigError(f"{setting}: {message} ({context})") from None


def validate(settings: Settings) -> None:
    """Every check ``relay consume`` makes of its settings before it opens a server:
    channel settings (secrets, sender, accounts, networks), rate budgets and attempt
    budgets. Raises ConfigError naming the setting; ``relay consume --check`` runs it."""
    channels(settings)  # adapters open nothing until their first send: nothing to close
    try:
        budget.parse_budgets(settings.budgets)
    except ValueError as exc:
        raise errors.ConfigError(f"RELAY_BUDGETS: {exc}") from None
    try:
        policy(settings)
    except ValueError as exc:
        raise errors.ConfigError(f"RELAY_MAX_ATTEMPTS_PER_CHANNEL: {exc}") from None
    destination_guard(settings)


def destination_share(settings: Settings) -> int:
    """Sends one destination may have in flight in this process."""
    return max(1, int(settings.prefetch * settings.destination_max_share))


def destination_guard(settings: Settings) -> isolation.DestinationGuard:
    """Each destination's share of this process and its circuit breaker."""
    return isolation.DestinationGuard(
        max_in_flight=destination_share(settings),
        failure_threshold=settings.breaker_failure_threshold,
        cooldown_seconds=settings.breaker_cooldown_seconds,
        max_wait_seconds=settings.destination_wait_seconds,
    )


def targets(settings: Settings) -> registry.DestinationPolicy:
    """How the consumer opens destinations' secrets and when a failure streak disables."""
    return registry.DestinationPolicy(
        vault=destinations.vault_from_keys(
            [k.get_secret_value() for k in settings.destination_secrets_keys]
        ),
        failure_streak=settings.destination_failure_streak,
        failure_span_seconds=settings.destination_failure_span_seconds,
        hold_seconds=settings.destination_hold_seconds,
    )


def policy(settings: Settings) -> retry.RetryPolicy:
    return retry.RetryPolicy(
        base_seconds=settings.retry_base_seconds,
        multiplier=settings.retry_multiplier,
        max_seconds=settings.retry_max_seconds,
        retry_after_max_seconds=settings.retry_after_max_seconds,
        max_attempts=settings.max_attempts,
        max_attempts_by_channel=retry.parse_attempts_by_channel(settings.max_attempts_per_channel),
    )


def budgets_for(settings: Settings, pool: asyncpg.Pool) -> budget.Budgets:
    """The providers' rate budgets (``setup()`` writes them; ``close()`` stops refills)."""
    return budget.Budgets(
        pool,
        budget.parse_budgets(settings.budgets),
        urgent_reserve_fraction=settings.budget_urgent_reserve,
    )


def store_for(
    settings: Settings, pool: asyncpg.Pool, watch: DatabaseWatch, stopping: asyncio.Event
) -> store.Store:
    """The consumer's ledger store, not started (``start()``, then ``close()``)."""
    return store.Store(
        pool,
        watch,
        lease_seconds=settings.lease_seconds,
        batch_max=settings.write_batch_max,
        linger_seconds=settings.write_batch_linger_seconds,
        # Few concurrent flushes make each one bigger: fewer round trips.
        concurrency=max(1, min(2, settings.database_pool_size - 2)),
        stopping=stopping,
    )


def _gate(settings: Settings, budgets: budget.Budgets, metrics: Metrics) -> gate.Gate:
    return gate.Gate(
        guard=destination_guard(settings),
        budgets=budgets,
        metrics=metrics,
        lease_seconds=settings.lease_seconds,
        send_timeout_seconds=settings.http_timeout_seconds,
        budget_max_wait_seconds=settings.budget_max_wait_seconds,
    )


def worker_for(
    settings: Settings,
    ledger_store: store.Store,
    budgets: budget.Budgets,
    publisher: publishing.ConfirmedPublisher,
    adapters: Mapping[str, Channel],
    metrics: Metrics,
    tracer: trace.Tracer | None,
    acks: GroupedAcks,
    stopping: asyncio.Event,
    *,
    on_broker_failure: Callable[[], None],
) -> worker.Worker:
    """The worker and its deliverer over a started store and set-up budgets (it opens
    nothing itself: the session opened those and closes them)."""
    topology = amqp.Topology.from_settings(settings)
    crash = CrashPoints(settings.crash_at)
    deliverer = delivery.Deliverer(
        store=ledger_store,
        gate=_gate(settings, budgets, metrics),
        channels=adapters,
        policy=policy(settings),
        metrics=metrics,
        clock=SystemClock(),
        budgets_pause=budgets.pause,
        crash=crash,
        targets=targets(settings),
        held_recheck_seconds=settings.run_hold_recheck_seconds,
        reconciler=reconcile.Reconciler(
            store=ledger_store,
            metrics=metrics,
            clock=SystemClock(),
            hold_seconds=settings.reconcile_hold_seconds,
        ),
    )
    settler = settle.Settler(
        publisher=publisher,
        mark_dead_lettered=ledger_store.mark_dead_lettered,
        on_broker_failure=on_broker_failure,
        acks=acks,
        crash=crash,
    )
    return worker.Worker(
        store=ledger_store,
        deliverer=deliverer,
        settler=settler,
        config=worker.WorkerConfig(
            send_timeout_seconds=settings.http_timeout_seconds,
            lane_queues={lane: topology.lane_queue(lane) for lane in (amqp.BULK, amqp.URGENT)},
        ),
        metrics=metrics,
        stopping=stopping,
        acks=acks,
        tracer=tracer,
    )


def overdue_sweep(
    settings: Settings,
    pool: asyncpg.Pool,
    connection: AbstractConnection,
    publisher: publishing.ConfirmedPublisher,
    metrics: Metrics,
    on_unclaimed: Callable[[], None],
) -> Coroutine[Any, Any, None] | None:
    """The overdue sweep's loop for one broker session; None when it is turned off.
    ``on_unclaimed`` ends the session (its lanes do not deliver to it)."""
    if settings.overdue_sweep_seconds <= 0:
        return None
    topology = amqp.Topology.from_settings(settings)
    count_waiting = functools.partial(
        brokers.ready_total, connection, topology.waiting_queues(), settings.amqp_timeout_seconds
    )
    lanes = [topology.lane_queue(lane) for lane in (amqp.URGENT, amqp.BULK)]
    count_lanes_ready = functools.partial(
        brokers.ready_total, connection, lanes, settings.amqp_timeout_seconds
    )
    sweep = overdue.OverdueSweep(
        pool=pool,
        publisher=publisher,
        count_waiting=count_waiting,
        count_lanes_ready=count_lanes_ready,
        metrics=metrics,
        after_seconds=settings.overdue_after_seconds,
        limit=settings.rescue_batch_limit,
        on_unclaimed=on_unclaimed,
    )
    return overdue.run_sweep(sweep, settings.overdue_sweep_seconds)
