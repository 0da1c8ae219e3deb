"""The ``relay`` arguments of provider receipts and suppression: ``receipts`` and
``suppressions`` (``service.ops.cli`` adds them to its parser; their handlers are
``service.ops.handlers``)."""

from __future__ import annotations

import argparse

from service.ops import cli_operators
from service.ops.cli_operators import Command


def add(sub: argparse._SubParsersAction, command: Command) -> None:  # type: ignore[type-arg]
    command(
        sub,
        "receipts",
        "take the providers' status callbacks (e-mail, SMS) on RELAY_RECEIPTS_HOST:PORT",
        "relay receipts   (with RELAY_EMAIL_WEBHOOK_SECRETS and RELAY_SMS_AUTH_TOKEN set)",
    )
    _add_suppressions(sub, command)


def _add_suppressions(sub: argparse._SubParsersAction, command: Command) -> None:  # type: ignore[type-arg]
    sup = command(
        sub,
        "suppressions",
        "the addresses and numbers no e-mail or SMS is sent to (list, add, remove)",
        "relay suppressions list --channel email",
        "relay suppressions add sms +14155550123 --reason 'asked us to stop'",
    )
    ssub = sup.add_subparsers(dest="action", required=True, metavar="ACTION")
    lst = command(
        ssub,
        "list",
        "the suppressions in force, newest first (--all: lifted ones too)",
        "relay suppressions list --channel email --json",
    )
    lst.add_argument("--channel", choices=["email", "sms"], default=None, help="one channel only")
    lst.add_argument("--all", action="store_true", help="also the suppressions lifted since")
    lst.add_argument("--limit", type=int, default=1000, help="most rows (default 1000)")
    cli_operators.add_json(lst)
    for name, summary, example in (
        ("add", "suppress an address or number by hand", "add email ann@example.com --reason X"),
        (
            "remove",
            "lift a suppression (the record stays)",
            "remove email ann@example.com --reason Y",
        ),
    ):
        action = command(ssub, name, summary, f"relay suppressions {example}")
        action.add_argument("channel", choices=["email", "sms"], help="email or sms")
        action.add_argument("address", help="the e-mail address, or the number in E.164")
        action.add_argument("--reason", required=True, help="why, recorded with it")
        cli_operators.add_operator(action)
        cli_operators.add_json(action)
