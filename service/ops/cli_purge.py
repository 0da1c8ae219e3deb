"""The ``relay`` arguments of retention: ``purge`` (``service.ops.cli`` adds them to its
parser and its handlers; the handler is ``service.ops.purge_cmd``)."""

from __future__ import annotations

import argparse

from service.ops.cli_operators import Command, add_json


def add(sub: argparse._SubParsersAction, command: Command) -> None:  # type: ignore[type-arg]
    parser = command(
        sub,
        "purge",
        "remove what the retention policy (RELAY_RETENTION_*) no longer keeps: final "
        "deliveries' content, then their rows, old runs and audit records (CronJob, daily)",
        "relay purge --dry-run",
        "relay purge --json",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="count what would be purged, table by table; change nothing",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows per transaction (default RELAY_RETENTION_BATCH_SIZE, 5000)",
    )
    parser.add_argument(
        "--rows-per-second",
        type=int,
        default=None,
        metavar="N",
        help="at most N rows a second per step, sleeping between batches (default "
        "RELAY_RETENTION_PURGE_ROWS_PER_SECOND, 1500; 0: as fast as the database goes)",
    )
    parser.add_argument(
        "--yield-seconds",
        type=int,
        default=None,
        metavar="S",
        help="while deliveries are due, wait between batches, up to S seconds in all, then "
        "carry on at the pace (default RELAY_RETENTION_PURGE_YIELD_SECONDS, 1800; 0: never)",
    )
    add_json(parser)
