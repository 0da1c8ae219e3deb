"""A three-node RabbitMQ cluster loses a node (issue 19).

Three throwaway nodes (own ports, node names and directories, one shared Erlang cookie)
joined into one cluster, shared by this module's tests; each test uses its own namespace,
declares its quorum queues with ``RELAY_AMQP_QUORUM_GROUP_SIZE=3`` and reaches the
cluster through ``RELAY_AMQP_URL`` naming all three nodes. A node a test killed is started
again (it rejoins the cluster) before the next test.

- A drain of a few thousand deliveries (two supervised ``relay consume``, a ``relay
  publish`` every 3 s): the node leading the bulk work queue is SIGKILLed a quarter of the
  way through. Every row is delivered, the partner sees one logical event per key, no
  dead letter, and no consumer exits: a consumer connected to the lost node reconnects to
  another in the same process.
- A publish run whose node is SIGKILLed under it: every row the ledger marks ``queued``
  has its message in the work queue (nothing marked queued without a confirm), and the
  next run, through another node, publishes the rest.
- The node of the timer ladder (classic queues, not replicated) down: deliveries admitted
  ahead of their due time go through the delay tiers instead, and are delivered, none early.
- That node SIGKILLed with 500 deliveries waiting in the ladder: the consumer's overdue sweep
  republishes each row shortly after its due time (its stamp, read from the ledger, within
  lease + 30 s of due), every one is delivered once, and the originals that come back with
  the node are acked without a send and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aio_pika
import asyncpg
import pytest
from pydantic import SecretStr

from service import amqp, brokers, db, messages
from service.settings import Settings
from tests.support import relay as rs
from tests.support import replication
from tests.support.fleet import Facts, drain_settings, eventually, start_drain
from tests.support.nodes import NodeError, PostgresNode, RabbitNode
from tests.support.relay import RunningPartner

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

SIZE = 3
ROWS = 2000


@dataclass
class Cluster:
    nodes: list[RabbitNode]

    @property
    def url(self) -> str:
        """One URL naming every node, as RELAY_AMQP_URL takes a cluster."""
        return "amqp://guest:guest@" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes) + "/"

    def running(self) -> list[RabbitNode]:
        return [n for n in self.nodes if n.running]

    def leader(self, queue: str) -> RabbitNode | None:
        """The node leading a quorum queue now (asked of a running node); None while the
        queue is not listed with a leader (an election after its leader died)."""
        out = self.running()[0].ctl("list_queues", "name", "leader", "--no-table-headers")
        leaders = dict(line.split("\t")[:2] for line in out.splitlines() if "\t" in line)
        return next((n for n in self.nodes if n.node_name == leaders.get(queue)), None)

    def leaderless(self) -> list[str]:
        """Quorum queues not led by a running node (an election after a node died)."""
        live = {n.node_name for n in self.running()}
        out = self.running()[0].ctl("list_queues", "name", "type", "leader", "--no-table-headers")
        rows = [line.split("\t") for line in out.splitlines()]
        return [r[0] for r in rows if len(r) >= 3 and r[1] == "quorum" and r[2] not in live]

    def homes(self, queues: list[str]) -> list[RabbitNode]:
        """The nodes these classic queues live on, each once (one ``list_queues``)."""
        out = self.running()[0].ctl("list_queues", "name", "pid", "--no-table-headers")
        pids = dict(line.split("\t")[:2] for line in out.splitlines() if "\t" in line)
        return [
            n for n in self.nodes if any(pids[q].startswith(f"<{n.node_name}.") for q in queues)
        ]

    def members(self) -> int:
        """Running nodes of the cluster, as a running node sees them."""
        out = self.running()[0].ctl("eval", "length(rabbit_nodes:all_running()).")
        return int(out)


def _start_cluster(base: Path) -> Cluster:
    return Cluster(replication.start_cluster(base, SIZE))


def _stop(cluster: Cluster) -> None:
    replication.stop_cluster(cluster.nodes)


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = _start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster
    finally:
        _stop(cluster)


@pytest.fixture
def cluster(module_cluster: Cluster) -> Cluster:
    """The module's cluster with every node running (one a previous test killed rejoins)."""
    for node in module_cluster.nodes:
        if not node.running:
            node.start()  # it rejoins the cluster it was in
    replication.await_cluster(module_cluster.nodes[0], SIZE)
    assert module_cluster.members() == SIZE
    return module_cluster


async def test_killing_the_work_queue_leader_during_a_drain_loses_nothing(
    cluster: Cluster, pg: PostgresNode, partner: RunningPartner, tmp_path: Path
) -> None:
    assert partner.state.verify_secret is not None
    settings = drain_settings(
        database_url=pg.url,
        amqp_url=cluster.url,
        secret=partner.state.verify_secret,
        state_dir=tmp_path,
        amqp_quorum_group_size=SIZE,
    )
    async with start_drain(settings, partner, tmp_path / "logs", rows=ROWS) as fleet:
        await fleet.wait_delivered(ROWS // 4, timeout=60)
        queue = f"{fleet.namespace}.deliveries"
        leader = await asyncio.to_thread(cluster.leader, queue)
        assert leader is not None, f"{queue} has no leader before the kill"
        fleet.note(f"SIGKILL {leader.node_name}, leader of {queue}")
        await asyncio.to_thread(leader.kill)
        killed = fleet.note("leader killed")

        async def new_leader() -> bool:
            try:
                now = await asyncio.to_thread(cluster.leader, queue)
            except NodeError:  # the node asked is busy electing: ask again
                return False
            return now is not None and now is not leader

        facts = Facts(fleet)
        # Each look is a rabbitmqctl run, an Erlang VM of its own (~0.7 CPU-s): once a second.
        facts.check(await eventually(new_leader, 30, interval=1.0), f"{queue} got no new leader")
        await fleet.expect_all_delivered(facts, within=settings.lease_seconds + 30, since=killed)
        facts.check(
            not fleet.unrequested_exits(),
            "a consumer exited: losing one node must cost a reconnect, not a restart: "
            + "; ".join(map(str, fleet.unrequested_exits())),
        )
        reconnected = [
            s.index for s in fleet.supervisor.slots if await rs.logged(s.log, "broker_reconnect")
        ]
        fleet.note(f"consumers that reconnected: slots {reconnected}")
        await fleet.finish(facts)  # no dead letters, one event per key, SIGTERMs in bound
        facts.assert_all()


async def _message_ids(url: str, queue: str) -> list[int]:
    """The delivery ids of every message in ``queue``, read without removing any.

    Callers expect messages there: a count of 0 is read again for up to 60 s, since a
    quorum queue electing a new leader (its old one just killed) reports none meanwhile."""
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            declared = await channel.declare_queue(queue, passive=True)
            count = declared.declaration_result.message_count or 0
            if count or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(1)
        ids: list[int] = []
        if not count:
            return ids
        await channel.set_qos(prefetch_count=count)  # none is acked: room for all at once
        with contextlib.suppress(TimeoutError):  # a quiet queue: every message was read
            async with declared.iterator(timeout=15) as received:
                async for message in received:
                    ids.append(messages.decode(message.body).delivery_id)
                    if len(ids) == count:
                        break
        await channel.close()  # unacked: every message stays in the queue
    return ids


async def _queued_ids(pool: asyncpg.Pool) -> set[int]:
    rows = await pool.fetch("SELECT id FROM deliveries WHERE state::text = 'queued'")
    return {int(r["id"]) for r in rows}


async def test_a_publish_run_losing_its_node_marks_queued_only_what_was_confirmed(
    cluster: Cluster, pg: PostgresNode, partner: RunningPartner, tmp_path: Path
) -> None:
    settings = drain_settings(
        database_url=pg.url,
        amqp_url=cluster.url,
        secret="whsec_unused",
        state_dir=tmp_path,
        amqp_quorum_group_size=SIZE,
        publish_batch_size=200,
        # Few confirms in flight: the run lasts long enough (seconds, even on a fast
        # machine) for the test to kill its node mid-run.
        publish_max_in_flight=4,
    )
    assert (await rs.relay(settings, "migrate")).code == 0
    rows = 10_000
    pool = await db.create_pool(settings, size=2)
    try:
        past = datetime.now(UTC) - timedelta(seconds=5)
        await rs.load(pool, [rs.line(f"r{i}", partner.url(), due_at=past) for i in range(rows)])
        # The run is given one node, so the test knows which to kill without asking the
        # broker: a `rabbitmqctl list_connections` took so long on a loaded machine (two
        # suites at once) that the run had finished before it answered.
        victim = cluster.nodes[1]
        one_node = settings.model_copy(update={"amqp_url": SecretStr(victim.url)})
        run = asyncio.create_task(rs.relay(one_node, "publish", timeout=120))

        async def some_queued() -> bool:
            return len(await _queued_ids(pool)) >= 1000

        await rs.wait_for(some_queued, 60, "publishing under way", interval=0.02)
        assert not run.done(), "the run ended before its node could be killed"
        await asyncio.to_thread(victim.kill)
        first = await run
        queued = await _queued_ids(pool)
        assert first.code != 0 or len(queued) == rows, first.stderr[-2000:]
        alive = cluster.running()[0]
        lane = amqp.Topology.from_settings(settings).lane_queue(amqp.BULK)
        in_queue = set(await _message_ids(alive.url, lane))
        assert queued <= in_queue, f"{len(queued - in_queue)} rows queued without a message"

        again = await rs.relay(settings, "publish", timeout=120)  # through a node still up
        assert again.code == 0, again.stdout + again.stderr[-2000:]
        queued = await _queued_ids(pool)
        assert len(queued) == rows
        in_queue = set(await _message_ids(alive.url, lane))
        assert queued <= in_queue, f"{len(queued - in_queue)} rows queued without a message"
    finally:
        await pool.close()
        with contextlib.suppress(Exception):
            await _delete_namespace(cluster, settings)


async def test_admitted_ahead_while_the_timer_node_is_down_they_hop_through_the_delay_tiers(
    cluster: Cluster, pg: PostgresNode, partner: RunningPartner, tmp_path: Path
) -> None:
    """The timer ladder is classic queues (one node, not replicated): with its node down, a
    delivery admitted before its due time comes back unroutable from the ladder and is
    published through the (replicated) delay tiers instead: queued at once, delivered, and
    not before it was due."""
    assert partner.state.verify_secret is not None
    settings = drain_settings(
        database_url=pg.url,
        amqp_url=cluster.url,
        secret=partner.state.verify_secret,
        state_dir=tmp_path,
        amqp_quorum_group_size=SIZE,
    )
    assert (await rs.relay(settings, "migrate")).code == 0
    assert (await rs.relay(settings, "publish")).code == 0  # declares the topology
    ladder = amqp.Topology.from_settings(settings).timer_queues
    (timer,) = await asyncio.to_thread(cluster.homes, ladder)
    await asyncio.to_thread(timer.kill)

    async def led_by_live_nodes() -> bool:
        try:
            return not await asyncio.to_thread(cluster.leaderless)
        except NodeError:  # the node asked is busy electing: ask again
            return False

    # The delay tiers it led elect new leaders first (seconds on a loaded machine): until
    # then a publish to them is not confirmed, and the run rightly leaves its rows pending.
    await rs.wait_for(led_by_live_nodes, 60, "the quorum queues' new leaders", interval=1.0)
    rows = 200
    pool = await db.create_pool(settings, size=2)
    consumer = None
    try:
        due = datetime.now(UTC) + timedelta(seconds=8)
        await rs.load(pool, [rs.line(f"r{i}", partner.url(), due_at=due) for i in range(rows)])
        published = await rs.relay(settings, "publish", timeout=120)
        assert published.code == 0, published.stdout + published.stderr[-2000:]
        assert len(await _queued_ids(pool)) == rows  # every one confirmed, none left pending
        consumer = await rs.start_consumer(settings, tmp_path / "consumer.log")

        async def all_delivered() -> bool:
            return (await rs.states(pool)).get("delivered", 0) == rows

        await rs.wait_for(all_delivered, 90, f"all {rows} delivered")
        early = await pool.fetchval(
            "SELECT count(*) FROM delivery_attempts a JOIN deliveries d ON d.id = a.delivery_id"
            " WHERE a.started_at < d.occurrence_at"
        )
        assert early == 0, f"{early} sends started before their due time"
        assert partner.state.logical_events == rows
    finally:
        if consumer is not None:
            assert await rs.stop(consumer) == 0
        await pool.close()
        with contextlib.suppress(Exception):
            await _delete_namespace(cluster, settings)


async def _ready(url: str, names: list[str]) -> int:
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        return await brokers.ready_total(connection, names, 10)


@pytest.mark.timeout(480)  # a busy 2-core machine: conditions below wait, they bound nothing
async def test_the_ladder_node_killed_with_500_waiting_each_row_is_republished_soon_after_due(
    cluster: Cluster, pg: PostgresNode, partner: RunningPartner, tmp_path: Path
) -> None:
    assert partner.state.verify_secret is not None
    settings = drain_settings(
        database_url=pg.url,
        amqp_url=cluster.url,
        secret=partner.state.verify_secret,
        state_dir=tmp_path,
        amqp_quorum_group_size=SIZE,
        overdue_after_seconds=5.0,
        overdue_sweep_seconds=1.0,
    )
    topology = amqp.Topology.from_settings(settings)
    log = tmp_path / "consumer.log"
    assert (await rs.relay(settings, "migrate")).code == 0
    consumer = await rs.start_consumer(settings, log)  # declares the ladder on its node
    rows = 500
    pool = await db.create_pool(settings, size=2)
    try:
        await rs.wait_for(lambda: rs.logged(log, "consume_started"), 60, "consumer up")
        homes = await asyncio.to_thread(cluster.homes, topology.timer_queues)
        assert len(homes) == 1, f"the ladder is spread over {[n.node_name for n in homes]}"
        (home,) = homes
        alive = next(n for n in cluster.nodes if n is not home)
        start = datetime.now(UTC) + timedelta(seconds=25)
        lines = [
            rs.line(f"r{i}", partner.url(), due_at=start + timedelta(seconds=8 * i / rows))
            for i in range(rows)
        ]
        await rs.load(pool, lines)
        published = await rs.relay(settings, "publish", timeout=120)
        assert published.code == 0, published.stdout + published.stderr[-2000:]
        assert await _ready(alive.url, topology.timer_queues) == rows, "all 500 in the ladder"
        await asyncio.to_thread(home.kill)

        async def all_delivered() -> bool:
            return (await rs.states(pool)).get("delivered", 0) == rows

        await rs.wait_for(all_delivered, 180, f"all {rows} delivered through the sweep")
        ledger = await pool.fetch(
            "SELECT d.occurrence_at, d.republished_at, d.attempts, a.started_at"
            " FROM deliveries AS d JOIN delivery_attempts AS a ON a.delivery_id = d.id"
        )
        assert len(ledger) == rows and all(r["attempts"] == 1 for r in ledger)
        assert all(r["started_at"] >= r["occurrence_at"] for r in ledger), "a send before due"
        late = sorted((r["republished_at"] - r["occurrence_at"]).total_seconds() for r in ledger)
        bound = settings.lease_seconds + 30
        assert settings.overdue_after_seconds <= late[0] and late[-1] <= bound, (late[0], late[-1])
        assert partner.state.logical_events == rows and partner.state.duplicates == 0
        print(f"\nrepublished {late[0]:.1f} to {late[-1]:.1f} s after due (bound {bound:.0f} s)")
        assert await rs.stop(consumer) == 0

        # The node comes back with the originals: each runs down the ladder to its lane.
        await asyncio.to_thread(home.start)

        async def ladder_empty() -> bool:
            return await _ready(home.url, topology.timer_queues) == 0

        await rs.wait_for(ladder_empty, 60, "the ladder run down")
        lanes = [topology.lane_queue(amqp.BULK), topology.lane_queue(amqp.URGENT)]
        seen: list[int] = []

        async def lanes_settled() -> bool:
            # The ladder's last dead letters may still be on their way to the lanes when it
            # reads empty (in a pair of suites 497 of 500 were counted here, and 500 came):
            # settled is the same count twice, 2 s apart.
            seen.append(await _ready(home.url, lanes))
            return len(seen) >= 2 and seen[-1] == seen[-2]

        await rs.wait_for(lanes_settled, 60, "the lanes settled", interval=2.0)
        back = seen[-1]
        assert 0 < back <= rows, back
        print(f"{back} of {rows} originals came back with the node")
        consumer = await rs.start_consumer(settings, log)

        async def survivors_counted() -> bool:
            counted = await rs.logged_count(log, "duplicate", republished=True)
            return counted == back and await _ready(home.url, lanes) == 0

        await rs.wait_for(survivors_counted, 180, f"{back} originals acked as counted no-ops")
        assert partner.state.logical_events == rows and partner.state.duplicates == 0
        assert await pool.fetchval("SELECT count(*) FROM delivery_attempts") == rows
    finally:
        if consumer.returncode is None:
            await rs.stop(consumer)
        await pool.close()
        with contextlib.suppress(Exception):
            await _delete_namespace(cluster, settings)


async def _delete_namespace(cluster: Cluster, settings: Settings) -> None:
    url = cluster.running()[0].url
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        await amqp.delete_topology(
            await connection.channel(), amqp.Topology.from_settings(settings)
        )
