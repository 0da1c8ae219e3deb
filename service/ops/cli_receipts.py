"""The ``relay`` arguments of provider receipts and suppression: ``receipts`` and
``suppressions`` (``service.ops.cli`` adds them to its parser and its handlers)."""

from __future__ import annotations

import argparse

from service.ops.cli_operators import Command

HANDLERS = {
    "receipts": "service.ops.receipts_server:main",
}


def add(sub: argparse._SubParsersAction, command: Command) -> None:  # type: ignore[type-arg]
    command(
        sub,
        "receipts",
        "take the providers' status callbacks (e-mail, SMS) on RELAY_RECEIPTS_HOST:PORT",
        "relay receipts   (with RELAY_EMAIL_WEBHOOK_SECRETS and RELAY_SMS_AUTH_TOKEN set)",
    )
