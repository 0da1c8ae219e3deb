"""What the timer ladder costs the broker and the consumer, per delivery.

Per run: a fresh namespace with the relay's whole topology (``service/amqp.py``), N
persistent messages published as ``relay publish`` publishes look-ahead deliveries (the
trace header, ``mandatory``, confirmed, at most 200 unconfirmed) into the ladder with waits
drawn uniformly from ``--wait-from``..``--wait-to`` s (``--direct``: published for now,
the baseline), and one consumer on the bulk lane queue that takes them as they fall due
(``no_ack``: the lane's own cost is not measured). Printed: RabbitMQ's CPU (``beam.smp``)
from the first publish to the last arrival, per message; the queues a message visited on
average (its x-death entries); this process's CPU per message (publish and receive, the
headers decoded by aiormq); lateness p50/p99/max (arrival - due) and deliveries that
arrived early (must be 0). The shared broker on 127.0.0.1; the machine should be
otherwise idle.

    .venv/bin/python bench/ladder_cost.py --count 10000 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import aio_pika
import uvloop
from _common import AMQP_URL, cpu_by_group, cpu_snapshot
from yardstick_publisher import TRACE_HEADER

from service import amqp, messages, timer
from service.settings import Settings


async def one_run(args: argparse.Namespace, seed: int) -> dict[str, float]:
    count, wait_from, wait_to = args.count, args.wait_from, args.wait_to
    namespace = f"bench-ladder-{uuid.uuid4().hex[:8]}"
    topology = amqp.Topology.from_settings(Settings(amqp_namespace=namespace))
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await amqp.declare(channel, topology)
        lane = await channel.get_queue(topology.lane_queue(amqp.BULK), ensure=False)
        rng = random.Random(seed)
        due_at: dict[int, float] = {}
        lateness: list[float] = []
        deaths: list[int] = []
        arrived = asyncio.Event()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            now = time.monotonic()
            delivery_id = messages.decode(message.body).delivery_id
            lateness.append(now - due_at[delivery_id])
            death = (message.headers or {}).get("x-death")
            deaths.append(len(death) if isinstance(death, list) else 0)
            if len(lateness) == count:
                arrived.set()

        tag = await lane.consume(on_message, no_ack=True)
        window = asyncio.Semaphore(200)
        work_cpu_before = time.process_time()
        before = cpu_snapshot()

        async def publish(delivery_id: int, wait: float) -> None:
            try:
                if args.direct:  # published for now: straight to the lane, no ladder
                    entrance, routing, wait = topology.work_exchange, {}, 0.0
                else:
                    entrance, routing = timer.route(namespace, wait)
                exchange = await channel.get_exchange(entrance, ensure=False)
                due_at[delivery_id] = time.monotonic() + wait
                message = aio_pika.Message(
                    messages.encode(delivery_id),
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT
                    if args.transient
                    else aio_pika.DeliveryMode.PERSISTENT,
                    headers={**TRACE_HEADER, **routing},
                )
                await exchange.publish(message, amqp.BULK, mandatory=True)
            finally:
                window.release()

        tasks = set()
        started = time.monotonic()
        for delivery_id in range(1, count + 1):
            await window.acquire()
            task = asyncio.create_task(publish(delivery_id, rng.uniform(wait_from, wait_to)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        published = time.monotonic() - started
        await asyncio.wait_for(arrived.wait(), timeout=wait_to + 120)
        after = cpu_snapshot()
        ours = time.process_time() - work_cpu_before
        broker = cpu_by_group(before, after, {}).get("beam.smp", 0.0)
        await lane.cancel(tag)
        await amqp.delete_topology(channel, topology)
    finally:
        await connection.close()
    lateness.sort()
    return {
        "broker_ms": broker / count * 1000,
        "visits": statistics.fmean(deaths),
        "this_process_ms": ours / count * 1000,
        "publish_s": published,
        "p50": lateness[len(lateness) // 2],
        "p99": lateness[int(len(lateness) * 0.99)],
        "max": lateness[-1],
        "early": sum(1 for late in lateness if late < 0),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--wait-from", type=float, default=5.0)
    parser.add_argument("--wait-to", type=float, default=20.0)
    parser.add_argument(
        "--direct", action="store_true", help="publish for now, past the ladder (its baseline)"
    )
    parser.add_argument(
        "--transient", action="store_true", help="non-persistent messages (the relay's are not)"
    )
    args = parser.parse_args()
    print(
        f"ladder: base {timer.BASE}, {len(timer.queues('x'))} queues; "
        f"{args.count} messages, "
        + (
            "published for now (no ladder)"
            if args.direct
            else f"waits {args.wait_from}-{args.wait_to} s"
        )
    )
    for run in range(args.runs):
        r = await one_run(args, seed=run)
        print(
            f"  run {run + 1}: broker {r['broker_ms']:.3f} CPU-ms/message, "
            f"{r['visits']:.2f} queues visited, this process {r['this_process_ms']:.3f} "
            f"CPU-ms/message (publish + receive), published in {r['publish_s']:.1f} s; "
            f"lateness p50 {r['p50']:.3f} p99 {r['p99']:.3f} max {r['max']:.3f} s, "
            f"early {r['early']}"
        )


if __name__ == "__main__":
    uvloop.run(main())
