"""The ``relay erase`` arguments (``service.ops.cli`` adds them to its parser and its
handlers)."""

from __future__ import annotations

import argparse

from service.ops import cli_operators
from service.ops.cli_operators import Command

HANDLERS = {"erase": "service.ops.erase_cmd:erase"}


def add(sub: argparse._SubParsersAction, command: Command) -> None:  # type: ignore[type-arg]
    erase = command(
        sub,
        "erase",
        "erase one recipient's data from every table (an erasure request); "
        "a dry run unless --apply",
        "relay erase --recipient ann@example.com",
        "relay erase --recipient '+1 415 555 0123' --reason 'DSAR-1234' --apply",
    )
    erase.add_argument(
        "--recipient",
        required=True,
        help="an e-mail address, a phone number ('+' and country code) or a webhook URL; "
        "matched in every spelling the ledger holds (case, E.164, URL normalisation)",
    )
    erase.add_argument("--reason", default=None, help="why (recorded; needed to apply)")
    erase.add_argument("--apply", action="store_true", help="do it (default: dry run)")
    erase.add_argument(
        "--dry-run", action="store_true", help="count what would change (the default)"
    )
    cli_operators.add_operator(erase)
    cli_operators.add_json(erase)
