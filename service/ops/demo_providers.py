"""The demo's e-mail and SMS side: local Resend- and Twilio-style providers that post real
signed receipts to a ``relay receipts`` the demo runs, and the reminders that use them.

Some messages are delivered, some late (a delivery-delayed event first), some bounce (a
hard bounce, an unknown handset: their addresses are then suppressed), one recipient
complains; ``relay status`` then shows accepted, delivered and bounced apart.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import socket
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

import aiohttp
from aiohttp import web

from service.ops import email_provider, partner, receipts_server, sms_provider
from service.ops.email_provider import EmailProvider
from service.ops.sms_provider import SmsProvider

EVENT_DELAY_SECONDS = 0.5  # between a provider's status events


@dataclass
class Providers:
    """The two local providers, where relay receipts listens, and the demo's secret."""

    email: EmailProvider
    sms: SmsProvider
    receipts_port: int
    webhook_secret: str
    runners: list[web.AppRunner]

    def env(self) -> dict[str, str]:
        """What every relay process of the demo needs to send e-mail and SMS to these
        providers, and what relay receipts needs to verify their callbacks."""
        return {
            "RELAY_EMAIL_API_KEY": email_provider.API_KEY,
            "RELAY_EMAIL_SENDER": "Reminders <reminders@example.com>",
            "RELAY_EMAIL_API_BASE_URL": f"http://127.0.0.1:{self.email.port}",
            "RELAY_SMS_ACCOUNT_SID": sms_provider.ACCOUNT_SID,
            "RELAY_SMS_AUTH_TOKEN": sms_provider.AUTH_TOKEN,
            "RELAY_SMS_FROM_NUMBER": sms_provider.FROM_NUMBER,
            "RELAY_SMS_API_BASE_URL": f"http://127.0.0.1:{self.sms.port}",
            "RELAY_EMAIL_WEBHOOK_SECRETS": self.webhook_secret,
            "RELAY_RECEIPTS_HOST": "127.0.0.1",
            "RELAY_RECEIPTS_PORT": str(self.receipts_port),
            "RELAY_RECEIPTS_PUBLIC_URL": f"http://127.0.0.1:{self.receipts_port}",
        }

    async def close(self) -> None:
        for runner in self.runners:
            await runner.cleanup()

    async def wait_ready(self, timeout_seconds: float) -> bool:
        """Whether relay receipts answers /readyz within ``timeout_seconds`` (the providers'
        first callbacks must not find its port closed)."""
        url = f"http://127.0.0.1:{self.receipts_port}/readyz"
        deadline = time.monotonic() + timeout_seconds
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                try:
                    async with session.get(url) as answer:
                        if answer.status == 200:
                            return True
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        return False

    def summary(self) -> list[str]:
        """What the providers saw, one line each."""
        emails = Counter(kind for kind, _ in self.email.callbacks)
        texts = Counter(status for status, _ in self.sms.callbacks)
        refused = sum(1 for _, answer in self.email.callbacks + self.sms.callbacks if answer != 200)
        posted = json.dumps(dict(sorted(emails.items())))
        return [
            f"   e-mail provider: {len(self.email.emails)} e-mails for "
            f"{len(self.email.requests)} keys; events posted: {posted}",
            f"   SMS provider: {len(self.sms.messages)} messages; status callbacks posted: "
            f"{json.dumps(dict(sorted(texts.items())))}",
            f"   callbacks relay receipts did not take: {refused}",
        ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start() -> Providers:
    """Both providers on free ports, posting to relay receipts' port (chosen now, taken by
    the ``relay receipts`` the demo starts)."""
    receipts_port = _free_port()
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    email = EmailProvider(
        webhook_url=f"http://127.0.0.1:{receipts_port}{receipts_server.EMAIL_PATH}",
        webhook_secret=secret,
        delay_seconds=EVENT_DELAY_SECONDS,
    )
    sms = SmsProvider(delay_seconds=EVENT_DELAY_SECONDS)
    runners = []
    for provider in (email, sms):
        runner, provider.port = await partner.serve(provider.app())
        runners.append(runner)
    return Providers(email, sms, receipts_port, secret, runners)


def reminder_lines(count: int) -> list[str]:
    """``count`` e-mail and ``count`` SMS reminders due now: most delivered, every fifth
    e-mail late, every seventh a hard bounce, one complaint, one soft bounce; every sixth
    SMS to a number that does not exist, one to a handset that fails for now."""
    now = datetime.now(UTC).replace(microsecond=0).isoformat()
    lines = []
    for i in range(count):
        local = f"reader{i:03d}"
        if i % 7 == 3:
            local = f"bounce-{i:03d}"
        elif i % 5 == 2:
            local = f"slow-{i:03d}"
        elif i == 4:
            local = "complain-004"
        elif i == 6:
            local = "softbounce-006"
        payload = {"subject": f"Daily report {i}", "text": f"Your report number {i}."}
        lines.append(_line(f"mail-{i:03d}", "email", f"{local}@example.com", payload, now))
        number = f"+1415555{2000 + i:04d}"
        if i % 6 == 5:
            number = f"+1415{550 + i % 40}0000"  # undelivered 30005: suppressed
        elif i == 1:
            number = "+14155551111"  # failed 30008: bounced, not suppressed
        lines.append(_line(f"text-{i:03d}", "sms", number, {"body": f"Reminder {i}"}, now))
    return lines


def _line(reminder_id: str, channel: str, to: str, payload: dict[str, str], due: str) -> str:
    return json.dumps(
        {
            "id": reminder_id,
            "channel": channel,
            "destination": to,
            "payload": payload,
            "due_at": due,
        }
    )
