"""``relay receipts``: the HTTP endpoint the providers post their status callbacks to.

``POST /receipts/email``  Resend-style events, Svix-signed (``RELAY_EMAIL_WEBHOOK_SECRETS``)
``POST /receipts/sms``    Twilio-style status callbacks, ``X-Twilio-Signature`` (signed with
                          ``RELAY_SMS_AUTH_TOKEN``)
``GET /livez``, ``/readyz`` (the database answers), ``/metrics``

Every callback is verified before anything is read from it. Refused, with one log line and
nothing written: unsigned, badly signed or outside the signature's time tolerance (401),
not a body the provider sends (400), about a message this ledger never sent (404), an event
the ledger does not take (422). A database outage answers 503 (the provider sends it
again). A callback recorded answers 200, also when it had been recorded before.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiohttp import web
from opentelemetry.metrics import Counter, Meter

from service import (
    conventions,
    db,
    errors,
    logs,
    receipt_events,
    receipt_signatures,
    receipts,
    signals,
    suppressions,
    telemetry,
)
from service.receipt_events import ReceiptEvent, Refused
from service.settings import Settings

log = logs.get("receipts")

EMAIL_PATH = "/receipts/email"
SMS_PATH = "/receipts/sms"
_MAX_BODY_BYTES = 256 * 1024  # a provider's callback is a few KiB
_CLOSE_SECONDS = 5.0


@dataclass(frozen=True)
class Verifiers:
    """The secrets that verify each provider's callbacks (never in a repr)."""

    email_secrets: tuple[str, ...] = field(default=(), repr=False)
    sms_auth_token: str | None = field(default=None, repr=False)
    public_url: str = ""  # the address the providers were given (Twilio signs that URL)

    @classmethod
    def of(cls, settings: Settings) -> Verifiers:
        """From the settings; ConfigError when no channel could be verified."""
        verifiers = cls(
            email_secrets=tuple(s.get_secret_value() for s in settings.email_webhook_secrets),
            sms_auth_token=settings.sms_auth_token.get_secret_value() or None,
            public_url=settings.receipts_public_url,
        )
        if not verifiers.email_secrets and verifiers.sms_auth_token is None:
            raise errors.ConfigError(
                "RELAY_EMAIL_WEBHOOK_SECRETS: `relay receipts` needs it (e-mail callbacks), "
                "RELAY_SMS_AUTH_TOKEN (SMS callbacks), or both"
            )
        return verifiers


@dataclass(frozen=True)
class ReceiptMetrics:
    """``relay.receipts`` (recorded, by channel, outcome and whether new),
    ``relay.receipts.refused`` (by channel and why) and ``relay.suppressions.added``."""

    recorded: Counter
    refused: Counter
    suppressions: Counter

    @classmethod
    def create(cls, meter: Meter) -> ReceiptMetrics:
        return cls(
            recorded=meter.create_counter(
                "relay.receipts", "{receipt}", "Provider receipts recorded, by outcome"
            ),
            refused=meter.create_counter(
                "relay.receipts.refused", "{callback}", "Provider callbacks refused, by reason"
            ),
            suppressions=meter.create_counter(
                "relay.suppressions.added",
                "{address}",
                "Addresses suppressed by a provider's receipt, by channel and reason",
            ),
        )


class Endpoint:
    """The two callback routes over one pool."""

    def __init__(self, pool: asyncpg.Pool, verifiers: Verifiers, metrics: ReceiptMetrics) -> None:
        self._pool = pool
        self._verifiers = verifiers
        self._metrics = metrics

    async def email(self, request: web.Request) -> web.Response:
        if not self._verifiers.email_secrets:
            return self._refuse("email", "e-mail callbacks not configured", 404)
        body = await request.read()
        try:
            receipt_signatures.verify_svix(self._verifiers.email_secrets, body, request.headers)
        except receipt_signatures.BadSignature as exc:
            return self._refuse("email", f"signature: {exc}", 401)
        try:
            parsed = json.loads(body)
        except ValueError:
            return self._refuse("email", "body is not JSON", 400)
        event_id = receipt_signatures.svix_message_id(request.headers) or ""
        return await self._take("email", receipt_events.email_event(parsed, event_id))

    async def sms(self, request: web.Request) -> web.Response:
        token = self._verifiers.sms_auth_token
        if token is None:
            return self._refuse("sms", "SMS callbacks not configured", 404)
        form = await request.post()
        params = [(k, v) for k, v in form.items() if isinstance(v, str)]
        public = self._verifiers.public_url or f"{request.scheme}://{request.host}"
        try:
            receipt_signatures.verify_twilio(
                token, public + request.raw_path, params, request.headers.get("X-Twilio-Signature")
            )
        except receipt_signatures.BadSignature as exc:
            return self._refuse("sms", f"signature: {exc}", 401)
        event = receipt_events.sms_status(dict(params), dict(request.query))
        return await self._take("sms", event)

    async def _take(self, channel: str, event: ReceiptEvent | Refused) -> web.Response:
        if isinstance(event, Refused):
            return self._refuse(channel, event.reason, event.status)
        try:
            delivery_id = await receipts.delivery_of(self._pool, event)
            if delivery_id is None:
                return self._refuse(event.channel, "unknown message", 404)
            async with self._pool.acquire() as conn:
                recorded = await receipts.record(conn, event, delivery_id)
        except Exception as exc:
            if not db.is_unavailable(exc):
                raise
            return self._refuse(event.channel, "database unavailable", 503)
        self._metrics.recorded.add(
            1, {"channel": event.channel, "outcome": event.outcome, "new": str(recorded.new)}
        )
        if recorded.suppression_id is not None:
            reason = suppressions.reason_of(event) or "unknown"
            self._metrics.suppressions.add(1, {"channel": event.channel, "reason": reason})
        level = 20 if recorded.settled or event.permanent else 10
        log.log(
            level,
            "receipt recorded",
            extra={
                "event": "receipt",
                "delivery_id": delivery_id,
                "channel": event.channel,
                "outcome": event.outcome,
                "provider_event": event.event,
                "new": recorded.new,
                "state": recorded.state.value,
                "suppression_id": recorded.suppression_id,
            },
        )
        return web.json_response(
            {"recorded": recorded.new, "delivery_id": delivery_id, "state": recorded.state}
        )

    def _refuse(self, channel: str, reason: str, status: int) -> web.Response:
        """One log line, a counter, the status; nothing written."""
        label = telemetry.label_value(reason)
        self._metrics.refused.add(1, {"channel": channel, "reason": label})
        log.warning(
            "provider callback refused",
            extra={
                "event": "receipt_refused",
                "channel": channel,
                "reason": logs.redact(reason)[:200],
                "status": status,
            },
        )
        return web.json_response({"error": reason}, status=status)


def build(
    pool: asyncpg.Pool,
    verifiers: Verifiers,
    metrics: ReceiptMetrics,
    render_metrics: Callable[[str | None], tuple[bytes, str]] | None = None,
) -> web.Application:
    """The aiohttp application of ``relay receipts``."""
    endpoint = Endpoint(pool, verifiers, metrics)

    async def livez(_: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def readyz(_: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(2.0):
                await pool.fetchval(db.q("db_now"))
        except Exception:
            return web.json_response({"status": "not ready", "database": False}, status=503)
        return web.json_response({"status": "ready", "database": True})

    async def scrape(request: web.Request) -> web.Response:
        assert render_metrics is not None
        body, content_type = render_metrics(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application(client_max_size=_MAX_BODY_BYTES)
    app.router.add_post(EMAIL_PATH, endpoint.email)
    app.router.add_post(SMS_PATH, endpoint.sms)
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    if render_metrics is not None:
        app.router.add_get("/metrics", scrape)
    return app


@contextlib.asynccontextmanager
async def serving(
    settings: Settings,
    metrics: ReceiptMetrics,
    render_metrics: Callable[[str | None], tuple[bytes, str]] | None = None,
) -> AsyncIterator[int]:
    """``relay receipts`` listening on RELAY_RECEIPTS_HOST:PORT; yields its port."""
    verifiers = Verifiers.of(settings)  # a missing secret stops it before connecting
    async with contextlib.AsyncExitStack() as stack:
        pool = await db.create_pool(settings, size=min(settings.database_pool_size, 8))
        stack.push_async_callback(db.close_pool, pool, _CLOSE_SECONDS)
        app = build(pool, verifiers, metrics, render_metrics)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=_CLOSE_SECONDS)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, settings.receipts_host, settings.receipts_port)
        try:
            await site.start()
        except OSError as exc:
            where = f"{settings.receipts_host}:{settings.receipts_port}"
            raise errors.ConfigError(
                f"RELAY_RECEIPTS_PORT: cannot listen on {where} ({exc.strerror})"
            ) from None
        yield _port(runner)


def _port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        return int(address[1])
    raise AssertionError("a started site has an address")


async def main(args: argparse.Namespace, settings: Settings) -> int:
    """``relay receipts``: take the providers' callbacks until SIGTERM or SIGINT."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY

    async with contextlib.AsyncExitStack() as stack:  # one exit path, in reverse order
        telem = telemetry.setup("relay-receipts", [PrometheusMetricReader()])
        stack.callback(telem.shutdown)
        metrics = ReceiptMetrics.create(telem.meter_provider.get_meter("reminder-relay"))
        port = await stack.enter_async_context(serving(settings, metrics, _renderer(REGISTRY)))
        stop = stack.enter_context(signals.stopping_on_signals(asyncio.Event()))
        print(f"relay receipts: listening on {settings.receipts_host}:{port}", flush=True)
        log.info("receipts listening", extra={"event": "receipts_listening", "port": port})
        await stop.wait()
    return errors.ExitCode.OK


def _renderer(registry: Any) -> Callable[[str | None], tuple[bytes, str]]:
    return lambda accept: conventions.render_prometheus(registry, accept)
