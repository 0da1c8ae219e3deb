"""Which database errors the consumer waits out (an outage) and which it reports (a bug)."""

from __future__ import annotations

import asyncpg
import pytest

from service import db


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError(),
        TimeoutError(),
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed"),
        asyncpg.exceptions.TooManyConnectionsError("sorry, too many clients already"),
        asyncpg.InterfaceError("connection is closed"),
        # Seen when PostgreSQL was SIGKILLed under a busy connection (a drain): the
        # protocol was left mid-operation, and asyncpg says so before it sees the loss.
        asyncpg.InternalClientError(
            "cannot switch to state 12; another operation (2) is in progress"
        ),
    ],
)
def test_a_server_gone_or_busy_is_an_outage(exc: Exception) -> None:
    assert db.is_unavailable(exc)


@pytest.mark.parametrize(
    "exc",
    [
        asyncpg.exceptions.UniqueViolationError("duplicate key"),
        asyncpg.exceptions.CheckViolationError("new row violates check constraint"),
        asyncpg.InterfaceError("the number of query arguments cannot exceed 32767"),
        asyncpg.InternalClientError("unexpected data type"),
        ValueError("bad value"),
    ],
)
def test_an_error_in_what_was_asked_is_not_an_outage(exc: Exception) -> None:
    assert not db.is_unavailable(exc)
