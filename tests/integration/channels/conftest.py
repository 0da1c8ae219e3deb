"""Fixtures for the channel adapter tests (the servers live in tests/support/http_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import http_harness


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A loopback port that is bound but not listening: connecting is refused."""
    with http_harness.refusing_port() as port:
        yield port
