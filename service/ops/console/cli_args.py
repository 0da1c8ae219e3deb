"""The ``relay`` arguments of ``console`` and ``console-operators`` (``service.ops.cli``
adds them to its parser; their handlers are ``service.ops.handlers``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

# cli._command: (subparsers, name, summary, *examples) -> parser
Command = Callable[..., argparse.ArgumentParser]

_ACTIONS = (
    ("add", "make NAME a token (printed once) and write its hash into the file"),
    ("remove", "remove NAME: their token and sessions stop working"),
    ("list", "the operators' names"),
)


def add(sub: argparse._SubParsersAction, command: Command) -> None:  # type: ignore[type-arg]
    command(
        sub,
        "console",
        "serve the operator console (pages and /api/v1) on RELAY_CONSOLE_HOST:PORT",
        "relay console   (with RELAY_CONSOLE_OPERATORS_FILE=/run/secrets/console/operators)",
    )
    ops = command(
        sub,
        "console-operators",
        "add, remove or list the console's operators (each with a token of their own)",
        "relay console-operators add alice --file console-operators",
        "relay console-operators remove alice --file console-operators",
    )
    actions = ops.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, summary in _ACTIONS:
        example = f"relay console-operators {action}{'' if action == 'list' else ' alice'}"
        parser = command(actions, action, summary, f"{example} --file console-operators")
        if action != "list":
            parser.add_argument("name", metavar="NAME", help="the operator's name, as recorded")
        parser.add_argument(
            "--file",
            type=Path,
            default=None,
            help="the operators file (default: RELAY_CONSOLE_OPERATORS_FILE)",
        )
