"""The local e-mail and SMS providers with `relay receipts` in front of the ledger: each
provider posts real signed callbacks over HTTP to the receipts endpoint, served in this
event loop from the test's settings."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web
from opentelemetry.metrics import NoOpMeterProvider
from pydantic import SecretStr

from service.ops import email_provider, partner, receipts_server, sms_provider
from service.ops.email_provider import EmailProvider
from service.ops.sms_provider import SmsProvider
from service.settings import Settings

EMAIL_SECRET = "whsec_" + base64.b64encode(b"relay-test-email-webhook-secret!").decode()
SENDER = "Reminders <reminders@example.com>"


@dataclass
class Providers:
    email: EmailProvider
    sms: SmsProvider
    receipts_port: int
    settings: Settings  # the test's, with both channels on and receipts configured

    @property
    def receipts_url(self) -> str:
        return f"http://127.0.0.1:{self.receipts_port}"


def with_receipts(settings: Settings) -> Settings:
    """The settings ``relay receipts`` needs: the providers' secrets, any free port."""
    return settings.model_copy(
        update={
            "receipts_host": "127.0.0.1",
            "receipts_port": 0,
            "email_webhook_secrets": [SecretStr(EMAIL_SECRET)],
            "sms_auth_token": SecretStr(sms_provider.AUTH_TOKEN),
        }
    )


@asynccontextmanager
async def receipts_endpoint(settings: Settings) -> AsyncIterator[int]:
    """``relay receipts`` (its composition root's server) in this event loop; its port."""
    metrics = receipts_server.ReceiptMetrics.create(NoOpMeterProvider().get_meter("test"))
    async with receipts_server.serving(with_receipts(settings), metrics) as port:
        yield port


@asynccontextmanager
async def providers(settings: Settings, delay_seconds: float = 0.0) -> AsyncIterator[Providers]:
    """Both local providers and the receipts endpoint they call back."""
    async with receipts_endpoint(settings) as port:
        base = f"http://127.0.0.1:{port}"
        email = EmailProvider(
            webhook_url=f"{base}{receipts_server.EMAIL_PATH}",
            webhook_secret=EMAIL_SECRET,
            delay_seconds=delay_seconds,
        )
        sms = SmsProvider(delay_seconds=delay_seconds)
        runners: list[web.AppRunner] = []
        try:
            for provider in (email, sms):
                runner, provider.port = await partner.serve(provider.app())
                runners.append(runner)
            channels = with_receipts(settings).model_copy(
                update={
                    "email_api_key": SecretStr(email_provider.API_KEY),
                    "email_sender": SENDER,
                    "email_api_base_url": f"http://127.0.0.1:{email.port}",
                    "sms_account_sid": sms_provider.ACCOUNT_SID,
                    "sms_from_number": sms_provider.FROM_NUMBER,
                    "sms_api_base_url": f"http://127.0.0.1:{sms.port}",
                    "receipts_public_url": base,
                }
            )
            yield Providers(email, sms, port, channels)
            await email.wait_idle()
            await sms.wait_idle()
        finally:
            for runner in runners:
                await runner.cleanup()
