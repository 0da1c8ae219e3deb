"""Scale-out benchmark: 1, 2 and 4 ``relay consume`` processes draining one queue on a
three-node RabbitMQ cluster, and what stops the growth (the database, the broker or the CPU).

A throwaway cluster of three RabbitMQ nodes (own ports and directories, the helpers the
cluster fault tests use: ``scripts/services rabbit-node``), quorum queues replicated on all
three (``RELAY_AMQP_QUORUM_GROUP_SIZE=3``), the shared PostgreSQL. Per step (K consumers):
a fresh database and namespace, the lean receiver (``bench/receiver.py``), N webhook
reminders loaded and queued by ``relay reminders load`` + ``relay publish``, then K
``relay consume`` processes started at once, consumer i connecting first to node i mod 3
(``RELAY_AMQP_URL`` lists the nodes in a rotated order). Timed from the consumers' start
to N delivered in the ledger.

Reported per step: deliveries/s overall and steady (10-90 % delivered), the machine's busy
share, CPU by process group (consumers together, RabbitMQ's three nodes together,
PostgreSQL, receiver) in cores, and which of them limits: "CPU" when the machine is
≥ 90 % busy, else the group nearest to a whole core of its own. The receiver must count N
logical events, no duplicate, no bad signature, else the run fails.

    .venv/bin/python bench/scale_out.py                        # 20,000 per step, K = 1 2 4
    .venv/bin/python bench/scale_out.py --count 2000 --consumers 1 2   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import asyncpg
import drain
from _common import (
    RELAY,
    CpuMonitor,
    MachineLoad,
    bench_env,
    describe_groups,
    free_port,
    load_average,
    median,
    state_counts,
)

from tests.support import replication
from tests.support.nodes import RabbitNode

HERE = Path(__file__).resolve().parent
NODES = 3


@dataclass
class Step:
    consumers: int
    count: int
    wall_seconds: float
    steady_rate: float
    busy: float
    cores: dict[str, float]  # group -> cores used on average during the drain

    @property
    def rate(self) -> float:
        return self.count / self.wall_seconds

    @property
    def limit(self) -> str:
        if self.busy >= 0.9:
            return "CPU (the machine is busy)"
        group, cores = max(self.cores.items(), key=lambda kv: kv[1])
        return f"{group} ({cores:.2f} cores)"


def cluster_url(nodes: list[RabbitNode], first: int) -> str:
    """RELAY_AMQP_URL naming every node, node ``first`` first."""
    order = nodes[first:] + nodes[:first]
    return "amqp://guest:guest@" + ",".join(f"127.0.0.1:{n.port}" for n in order) + "/"


def _group(name: str) -> str:
    return {"beam.smp": "rabbitmq", "postgres": "postgresql"}.get(name, name)


async def one_step(args: argparse.Namespace, nodes: list[RabbitNode], k: int) -> Step:
    async with bench_env("scale", keep_scratch=args.keep_logs) as env:
        env.extra_env.update(
            {"RELAY_AMQP_URL": cluster_url(nodes, 0), "RELAY_AMQP_QUORUM_GROUP_SIZE": "3"}
        )
        port = free_port()
        receiver = drain._spawn(
            [sys.executable, str(HERE / "receiver.py"), "--port", str(port)],
            env.env(),
            env.scratch / "partner.log",
        )
        consumers = []
        try:
            await drain._wait_port(port, receiver)
            await drain._prepare(argparse.Namespace(count=args.count), env, port)
            pool = await asyncpg.create_pool(env.database_url, min_size=1, max_size=1)
            try:
                load = MachineLoad()
                monitor = CpuMonitor().start()
                monitor.ours[receiver.pid] = "receiver"
                started = time.monotonic()
                for i in range(k):
                    consumer_env = env.env(
                        prefetch=str(args.prefetch), amqp_url=cluster_url(nodes, i % NODES)
                    )
                    log = env.scratch / f"consumer-{i}.log"
                    consumers.append(drain._spawn([*RELAY, "consume"], consumer_env, log))
                    monitor.ours[consumers[-1].pid] = "consumers"
                samples: list[tuple[float, int]] = []
                delivered = 0
                while delivered < args.count:
                    if any(c.poll() is not None for c in consumers):
                        raise SystemExit("a consumer exited early")
                    if time.monotonic() - started > args.timeout:
                        raise SystemExit(f"timed out: {await state_counts(pool)}")
                    delivered = int(
                        await pool.fetchval(
                            "SELECT count(*) FROM deliveries WHERE state = 'delivered'"
                        )
                    )
                    samples.append((time.monotonic() - started, delivered))
                    if delivered < args.count:
                        await asyncio.sleep(0.2)
                wall = time.monotonic() - started
                busy = load.stop()
                groups = monitor.stop()
            finally:
                await pool.close()
            stats = await drain._partner_stats(port)
        finally:
            for consumer in consumers:
                drain._stop(consumer)
            drain._stop(receiver)
    t10, n10 = next(s for s in samples if s[1] >= 0.1 * args.count)
    t90, n90 = next(s for s in samples if s[1] >= 0.9 * args.count)
    cores: dict[str, float] = {}
    for name, seconds in groups.items():
        cores[_group(name)] = cores.get(_group(name), 0.0) + seconds / wall
    step = Step(k, args.count, wall, (n90 - n10) / max(t90 - t10, 1e-9), busy, cores)
    print(
        f"{k} consumer(s): {wall:6.2f} s -> {step.rate:6.0f} deliveries/s (steady 10-90 %: "
        f"{step.steady_rate:6.0f}/s) | machine busy {busy:4.0%} | limit: {step.limit} | "
        f"receiver {stats}\n   CPU during the drain: {describe_groups(groups, wall, top=8)}",
        flush=True,
    )
    if (stats.get("logical_events"), stats.get("duplicates"), stats.get("bad_signatures")) != (
        args.count,
        0,
        0,
    ):
        raise SystemExit(f"receiver counts wrong: {stats}")
    return step


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--count", type=int, default=20_000, help="deliveries per step (20000)")
    parser.add_argument("--consumers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=1, help="repeat the steps (1)")
    parser.add_argument("--prefetch", type=int, default=200, help="RELAY_PREFETCH (200)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    print(
        f"== scale-out: {args.count} deliveries per step, consumers {args.consumers}, "
        f"{NODES}-node RabbitMQ cluster; load average {load_average()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="relay-bench-cluster-") as base:
        nodes = await asyncio.to_thread(replication.start_cluster, Path(base), NODES)
        try:
            # The bench's own broker calls (queue depth, namespace removal) go to node 0.
            _common.AMQP_URL = f"amqp://guest:guest@127.0.0.1:{nodes[0].port}/"
            steps = [
                await one_step(args, nodes, k) for _ in range(args.rounds) for k in args.consumers
            ]
        finally:
            await asyncio.to_thread(replication.stop_cluster, nodes)
    print(
        "consumers | deliveries/s (steady) | machine busy | cores: consumers / rabbitmq / "
        "postgresql / receiver | limit"
    )
    for s in steps:
        c = s.cores
        print(
            f"{s.consumers} | {s.rate:.0f} ({s.steady_rate:.0f}) | {s.busy:.0%} | "
            f"{c.get('consumers', 0):.2f} / {c.get('rabbitmq', 0):.2f} / "
            f"{c.get('postgresql', 0):.2f} / {c.get('receiver', 0):.2f} | {s.limit}"
        )
    # Each round's steps against that round's single consumer: the growth, with its spread.
    rounds = [steps[i : i + len(args.consumers)] for i in range(0, len(steps), len(args.consumers))]
    for k in args.consumers:
        ratios = [
            next(s for s in r if s.consumers == k).steady_rate / r[0].steady_rate for r in rounds
        ]
        rates = [next(s for s in r if s.consumers == k).steady_rate for r in rounds]
        print(
            f"{k} consumer(s): steady {median(rates):.0f}/s median, x{median(ratios):.2f} "
            f"the first step's ({min(ratios):.2f}-{max(ratios):.2f} over {len(rounds)} round(s))"
        )


if __name__ == "__main__":
    asyncio.run(main())
