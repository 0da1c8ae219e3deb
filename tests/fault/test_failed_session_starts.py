"""Session starts that fail after the store opened leave nothing behind (issue 29, item 4).

A consumer runs in this process (so its asyncio tasks can be counted) against a RabbitMQ
node of the test's own, as a user of its own. Once it consumes, the test counts the
process's tasks, the broker connections the node sees (``rabbitmqctl list_connections``)
and this process's TCP sockets to the node (``/proc``), and the server-side connections
to the test's database (``pg_stat_activity``).

Then the user loses read access to the urgent lane queue and the node closes every
connection: the session ends and reconnect attempts begin. Each new session opens for
real (connection, topology, publisher, database watch, consume channel, rate budgets
written, the store and its batcher tasks started, the worker) and fails at
``basic.consume`` of the urgent lane, the one operation that needs read access: the node
refuses it (ACCESS_REFUSED, in its log), exactly in the window between opening the store
and consuming. After five such failures the read access comes back, the next session
consumes, and the counts are back where they were: no task, no broker connection and no
database connection was left by a failed start.
"""

from __future__ import annotations

import asyncio
import collections
import os
from pathlib import Path

import asyncpg
import pytest
from pydantic import SecretStr

from consumer import run as consume_run
from service import amqp, telemetry
from service.settings import Settings
from tests.conftest import BASE_DB_URL
from tests.support.fleet import eventually
from tests.support.nodes import RabbitNode
from tests.support.relay import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]

FAILED_STARTS = 5
USER = "relay-session-test"
_ESTABLISHED = "01"
_REFUSED = "operation basic.consume caused a channel exception access_refused"


def tasks() -> collections.Counter[str]:
    """This loop's tasks, by the name of the coroutine each runs."""
    return collections.Counter(
        getattr(t.get_coro(), "__qualname__", repr(t.get_coro())) for t in asyncio.all_tasks()
    )


def sockets_to(port: int) -> int:
    """This process's established TCP connections whose remote port is ``port``."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed since listed
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == _ESTABLISHED and fields[9] in inodes:
                found += 1
    return found


async def broker_connections(node: RabbitNode) -> int:
    """Connections the node has open (only the consumer connects to it)."""
    out = await asyncio.to_thread(node.ctl, "list_connections", "pid", "--no-table-headers")
    return len([line for line in out.splitlines() if line.strip()])


async def database_connections(db_name: str) -> int:
    """Server-side connections to the test's database (this check's own is elsewhere)."""
    conn = await asyncpg.connect(BASE_DB_URL)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1", db_name
        )
    finally:
        await conn.close()
    return count


def refusals(node: RabbitNode) -> int:
    """basic.consume calls the node refused, from its log."""
    if not node.log_file.exists():
        return 0
    return node.log_file.read_text(errors="replace").count(_REFUSED)


async def test_five_failed_session_starts_leave_no_task_and_no_connection(
    settings: Settings, db_name: str, rabbit: RabbitNode
) -> None:
    rabbit.ctl("add_user", USER, USER)
    rabbit.ctl("set_permissions", "-p", "/", USER, ".*", ".*", ".*")
    s = settings.model_copy(
        update={
            "amqp_url": SecretStr(f"amqp://{USER}:{USER}@127.0.0.1:{rabbit.port}/"),
            "database_pool_size": 2,  # min = max: the pool itself never grows
            "budgets": "webhook=100/10",  # every start writes its budgets
            "broker_outage_max_seconds": 600.0,
            "metrics_sample_seconds": 0.2,
            "overdue_sweep_seconds": 0.2,
        }
    )
    urgent = amqp.Topology.from_settings(s).lane_queue(amqp.URGENT)
    metrics = telemetry.noop()
    stop = asyncio.Event()
    consumer = asyncio.create_task(consume_run.run(s, metrics=metrics, stop=stop, rng=lambda: 0.0))
    try:
        await wait_for(lambda: _ready(metrics, True), 30, "the first session consuming")
        await asyncio.sleep(1.0)  # the sampler and the sweep ran a few rounds
        before = (tasks(), await broker_connections(rabbit), sockets_to(rabbit.port))
        pg_before = await database_connections(db_name)
        assert before[1:] == (1, 1), before  # one broker connection, seen from both ends
        assert refusals(rabbit) == 0

        # Read everything but the urgent lane: declaring and binding it still works.
        rabbit.ctl("set_permissions", "-p", "/", USER, ".*", ".*", f"^(?!{urgent}$).*")
        await asyncio.to_thread(rabbit.ctl, "close_all_connections", "test: end the session")
        await wait_for(lambda: _ready(metrics, False), 30, "the session ending")
        await wait_for(
            lambda: _refused(rabbit, FAILED_STARTS), 120, f"{FAILED_STARTS} failed starts"
        )
        assert not metrics.snapshot.ready  # none of them consumed
        rabbit.ctl("set_permissions", "-p", "/", USER, ".*", ".*", ".*")
        await wait_for(lambda: _ready(metrics, True), 120, "a session consuming again")

        async def settled() -> bool:
            grown = tasks() - before[0]
            links = (await broker_connections(rabbit), sockets_to(rabbit.port))
            return (
                not grown
                and links <= before[1:]
                and await database_connections(db_name) <= pg_before
            )

        if not await eventually(settled, 20):
            extra = tasks() - before[0]
            links = (await broker_connections(rabbit), sockets_to(rabbit.port))
            pg_after = await database_connections(db_name)
            raise AssertionError(
                f"left behind: tasks {dict(extra)}; broker connections {links} "
                f"(were {before[1:]}); database connections {pg_after} (were {pg_before})"
            )
        assert not consumer.done()
    finally:
        stop.set()
        code = await asyncio.wait_for(consumer, 60)
    assert code == 0
    # The process's own exit closed the rest.
    assert await broker_connections(rabbit) == 0
    assert sockets_to(rabbit.port) == 0


async def _ready(metrics: telemetry.Metrics, ready: bool) -> bool:
    return metrics.snapshot.ready is ready


async def _refused(node: RabbitNode, at_least: int) -> bool:
    return refusals(node) >= at_least
