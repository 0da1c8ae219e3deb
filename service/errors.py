"""The error taxonomy shared by every process, and the named exit codes."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes, documented in the README."""

    OK = 0
    INCOMPLETE = 1  # the run did its work only in part: rows are left for the next run
    CONFIG = 2  # bad setting, bad arguments or bad input file: nothing was done
    UNAVAILABLE = 3  # a required server (database, broker) could not be reached
    # Refused while something it would change is in flight (`relay erase` while one of the
    # recipient's deliveries is being sent): nothing was done; run it again shortly.
    IN_FLIGHT = 4
    BUG = 70  # an exception nobody expected (sysexits' EX_SOFTWARE): not 1, "incomplete"


class RelayError(Exception):
    """Base of the errors this code raises on purpose."""


class ConfigError(RelayError):
    """A setting or argument is invalid. The message names it; exit 2."""


class InputError(RelayError):
    """An input file is invalid. The message names the line; exit 2, nothing loaded."""


class UnavailableError(RelayError):
    """The database or the broker cannot be reached."""


class PublishError(RelayError):
    """A publish was not confirmed (nacked, returned as unroutable, or timed out)."""


class Abandoned(RelayError):
    """Work given up, not failed: the process is stopping or a server stays unreachable.

    The message that carried it is handed back for redelivery; no attempt is counted.
    """
