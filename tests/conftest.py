"""Fixtures shared by every test: real PostgreSQL, real RabbitMQ, real HTTP on 127.0.0.1.

Each test gets its own database (cloned from a migrated template, so it is fast; dropped
a batch at a time after the test) and its own broker namespace (every exchange and queue
name prefixed), removed afterwards. A
missing server fails the run: it is never a skip.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import asyncpg
import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from service import amqp, db
from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import heavy
from tests.support import relay as relay_support

# No wall-clock bounds on property tests: a budget case that takes 0.2 ms took 372 ms on a
# loaded machine (the 3.13 unit tests beside two suites) and failed Hypothesis's 200 ms
# deadline. The properties are what is tested, not how fast an example runs.
hypothesis_settings.register_profile(
    "relay", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
hypothesis_settings.load_profile("relay")

BASE_DB_URL = os.environ.get("RELAY_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
AMQP_URL = os.environ.get("RELAY_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
# Per session: concurrent test runs on one server must not drop each other's template.
TEMPLATE = f"relay_test_template_{os.getpid()}"
SECRET = "whsec_" + base64.b64encode(b"reminder-relay-test-secret-0001").decode()


def _db_url(name: str) -> str:
    return urlunsplit(urlsplit(BASE_DB_URL)._replace(path=f"/{name}"))


def _reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), 3
        ):
            return True
    except OSError:
        return False


# Fixtures that start a server once for a whole module: under pytest-xdist that module's
# tests stay on one worker (one node per module, not one per worker).
_MODULE_SERVERS = {"module_rabbit", "module_cluster"}
# Where a test lives says roughly how long it takes: the slow ones start first, so no
# worker is left running a long test alone at the end of a parallel run. First the fault
# modules (their groups are the longest units), then the tests known to be slow
# (tests/support/slow_tests.txt), longest first, then the rest by folder.
_ORDER = ("tests/fault/", "tests/integration/", "tests/deploy/", "tests/unit/")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slow = heavy.slow_tests()

    def rank(item: pytest.Item) -> tuple[bool, int, int]:
        path = item.nodeid
        folder = next((i for i, prefix in enumerate(_ORDER) if path.startswith(prefix)), 0)
        return not _is_fault(item), -slow.get(path.split("[")[0], 0), folder

    items.sort(key=rank)  # stable: file order within each folder
    # Fault modules in one group per CPU (tests/support/heavy.py): whole modules, so a
    # module's shared node stays on one worker, and at most that many run at once.
    fault = heavy.groups((_module(i) for i in items if _is_fault(i)), heavy.slots())
    for item in items:
        if _is_fault(item):
            item.add_marker(pytest.mark.xdist_group(f"fault-{fault[_module(item)]}"))
        elif _MODULE_SERVERS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group(_module(item)))


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _is_fault(item: pytest.Item) -> bool:
    return item.nodeid.startswith("tests/fault/")


# Held by this worker while it runs a fault module: at most one per CPU on the machine,
# whatever number of suites run (tests/support/heavy.py).
_FAULT_SLOT = heavy.Slot(heavy.slots())


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's alarm
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if _is_fault(item):
        _FAULT_SLOT.acquire()  # waiting for another suite's module is not this test's time
    yield
    if _is_fault(item) and (nextitem is None or _module(nextitem) != _module(item)):
        _FAULT_SLOT.release()  # the module's nodes went with this item's teardown
    if len(_finished_databases) >= _DROP_BATCH:
        # Here, not in the fixture's teardown: a batch of drops under two suites took over
        # 90 s, and the test that happened to end the batch failed its own timeout.
        _drop_finished()


@pytest.fixture(scope="session")
def servers_up() -> None:
    missing = [
        name
        for name, url, port in (("PostgreSQL", BASE_DB_URL, 5432), ("RabbitMQ", AMQP_URL, 5672))
        if not _reachable(url, port)
    ]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not reachable: run `scripts/services up` first")


@pytest.fixture(scope="session")
def template_db(servers_up: None) -> Iterator[str]:
    """A database migrated once per session, cloned by each test."""

    async def build() -> None:
        admin = await asyncpg.connect(BASE_DB_URL)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{TEMPLATE}"')
        finally:
            await admin.close()
        pool = await asyncpg.create_pool(_db_url(TEMPLATE), min_size=1, max_size=1)
        try:
            await db.migrate(pool)
        finally:
            await pool.close()

    asyncio.run(build())
    yield TEMPLATE

    async def drop() -> None:
        admin = await asyncpg.connect(BASE_DB_URL)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')
        finally:
            await admin.close()

    asyncio.run(drop())


# A finished test's database is dropped later, with others: PostgreSQL 15 forces an
# immediate checkpoint on every DROP DATABASE, and one per test (two workers, ~900 tests)
# kept the server flushing and writing full-page images all run long. A batch pays one
# real checkpoint; the rest of the batch find little left to flush.
_DROP_BATCH = 64
_finished_databases: list[str] = []


async def _admin(*statements: str) -> None:
    admin = await asyncpg.connect(BASE_DB_URL)
    try:
        for sql in statements:
            await admin.execute(sql)
    finally:
        await admin.close()


def _drop_finished() -> None:
    names, _finished_databases[:] = list(_finished_databases), []
    if names:
        asyncio.run(_admin(*(f'DROP DATABASE IF EXISTS "{n}" WITH (FORCE)' for n in names)))


@pytest.fixture(scope="session")
def finished_databases() -> Iterator[None]:
    """Drops what is left of the batch when the session ends."""
    yield
    _drop_finished()


@pytest.fixture
def db_name(template_db: str, finished_databases: None) -> Iterator[str]:
    name = f"relay_t_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"'))
    yield name
    # Its connections go now (the drop comes later): a straggler must not hold one of the
    # server's 100 connections, or write, while the next tests run.
    asyncio.run(
        _admin(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
    )
    _finished_databases.append(name)  # dropped with its batch after the test (below)


@pytest.fixture
def namespace(servers_up: None) -> Iterator[str]:
    ns = f"t{uuid.uuid4().hex[:10]}"
    yield ns

    async def cleanup() -> None:
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel()
            topology = amqp.Topology.from_settings(Settings(amqp_namespace=ns))
            # The work exchange is declared first (amqp.declare): without it, nothing of
            # this namespace was. Most tests never declare one, and deleting the ~40 names
            # of both tier sets cost the shared broker ~40 ms of CPU per test.
            try:
                await channel.declare_exchange(topology.work_exchange, passive=True)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                return
            for tiers in (topology.delay_tiers_seconds, (0.5, 1.0, 2.0, 5.0)):
                await amqp.delete_topology(
                    channel, amqp.Topology(ns, tuple(tiers), topology.delivery_limit)
                )

    asyncio.run(cleanup())


@pytest.fixture
def settings(db_name: str, namespace: str, tmp_path: object) -> Settings:
    """Settings for one test: its own database and namespace, loopback allowed,
    short delays so retries happen in seconds."""
    return Settings(
        database_url=_db_url(db_name),  # type: ignore[arg-type]
        amqp_url=AMQP_URL,  # type: ignore[arg-type]
        amqp_namespace=namespace,
        allow_networks="127.0.0.0/8",
        webhook_signing_secrets=[SECRET],  # type: ignore[list-item]
        delay_tiers_seconds=[0.5, 1.0, 2.0, 5.0],
        retry_base_seconds=0.5,
        retry_multiplier=2.0,
        retry_max_seconds=5.0,
        lease_seconds=3.0,
        http_timeout_seconds=2.0,
        health_port=0,
        shutdown_grace_seconds=10.0,
        rescue_after_seconds=30.0,
        # Tests run side by side (pytest-xdist workers, and maybe a second suite) on one
        # server with 100 connections; some start a dozen relay processes at once.
        database_pool_size=4,
        state_dir=tmp_path,  # type: ignore[arg-type]
        # A purge waits while deliveries are due; most tests' ledgers keep open deliveries
        # on purpose (test_purge_yield turns the wait on).
        retention_purge_yield_seconds=0,
    )


@pytest.fixture
async def pool(settings: Settings) -> AsyncIterator[asyncpg.Pool]:
    """The test's own view of its database. Its statements get 60 s, not the relay's 10:
    a test watching a drain must not fail because two suites at once slowed a count (one
    over 20,000 rows being published took longer than 10 s in such a pair)."""
    p = await db.create_pool(
        settings.model_copy(update={"database_command_timeout_seconds": 60.0}), size=4
    )
    yield p
    await p.close()


@pytest.fixture
async def partner() -> AsyncIterator[relay_support.RunningPartner]:
    state = partner_mod.Partner(verify_secret=SECRET)
    runner, port = await partner_mod.start(state)
    yield relay_support.RunningPartner(state, port)
    await runner.cleanup()
