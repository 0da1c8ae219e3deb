"""Throwaway servers for fault tests: each test may kill, stop or hang its own.

A node that cannot start fails the test (``NodeError``); it is never a skip. Every node
is stopped and its data removed when the fixture ends, whatever the test did.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.nodes import (
    PostgresNode,
    RabbitNode,
    free_port,
    free_ports,
    start_postgres,
    start_rabbitmq,
)
from tests.support.proxy import ProxyThread


@pytest.fixture
def rabbit(tmp_path: Path) -> Iterator[RabbitNode]:
    """A RabbitMQ node of this test's own."""
    port, dist_port = free_ports(2)
    node = start_rabbitmq(tmp_path, port, dist_port)
    try:
        yield node
    finally:
        node.cleanup()


@pytest.fixture(scope="module")
def module_rabbit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitNode]:
    """A RabbitMQ node shared by one module's tests (each uses its own namespace); for
    tests that break something else and only need a broker nobody else touches."""
    port, dist_port = free_ports(2)
    node = start_rabbitmq(tmp_path_factory.mktemp("rabbit"), port, dist_port)
    try:
        yield node
    finally:
        node.cleanup()


@pytest.fixture(autouse=True)
def _module_rabbit_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails while the module's node is stopped or killed leaves it running for
    the next test: one failure, not every test after it (one did fail three)."""
    yield
    if "module_rabbit" in request.fixturenames:
        node: RabbitNode = request.getfixturevalue("module_rabbit")
        if not node.running:
            node.restart()


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[PostgresNode]:
    """A PostgreSQL cluster of this test's own (its ``postgres`` database)."""
    node = start_postgres(tmp_path, free_port())
    try:
        yield node
    finally:
        node.cleanup()


@pytest.fixture
def pg_proxy(pg: PostgresNode) -> Iterator[ProxyThread]:
    """A TCP proxy in front of ``pg`` (pass, hang, cut); closed after the test."""
    proxy = ProxyThread(pg.port)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.close()
