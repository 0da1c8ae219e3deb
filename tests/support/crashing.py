"""A ``relay`` subcommand handler with a bug in it, for the test of how a bug is reported."""

from __future__ import annotations

import argparse

from service.settings import Settings


async def handler(args: argparse.Namespace, settings: Settings) -> int:
    """Fail as a bug would (with an address in the message, which must not be printed)."""
    raise ValueError("day is out of range for month (for customer@example.com)")
