"""A yardstick publisher for ``bench/yardstick_publish.py``: the least a process must do to
put N delivery messages on the relay's work queue with publisher confirms, and nothing
else.

The same messages ``relay publish`` sends (body ``{"v": 1, "delivery_id": N}`` from
``service/messages.py``, JSON content type, persistent, ``mandatory``, the same trace
header), through the same exchange and routing key into the same quorum lane queue, on one
confirming aio-pika channel with at most ``--max-in-flight`` unconfirmed (the relay's
``RELAY_PUBLISH_MAX_IN_FLIGHT``). No database: ids are 1..N. Any unconfirmed or returned
publish ends the process with exit 1. uvloop, as every relay command.

    python bench/yardstick_publisher.py --amqp-url amqp://... \\
        --exchange bench-1234abcd.work --routing-key bulk --count 100000
"""

from __future__ import annotations

import argparse
import asyncio

import aio_pika
import uvloop

from service import messages

# What the relay's publish run carries in every message (service/telemetry.py): one W3C
# trace context header, the same length.
TRACE_HEADER = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}


async def publish(args: argparse.Namespace) -> None:
    connection = await aio_pika.connect(args.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange(args.exchange, ensure=False)
        window = asyncio.Semaphore(args.max_in_flight)
        failures: list[BaseException] = []

        async def one(delivery_id: int) -> None:
            try:
                message = aio_pika.Message(
                    messages.encode(delivery_id),
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    headers=dict(TRACE_HEADER),
                )
                await exchange.publish(message, args.routing_key, mandatory=True)
            except Exception as exc:
                failures.append(exc)
            finally:
                window.release()

        pending: set[asyncio.Task[None]] = set()
        for delivery_id in range(1, args.count + 1):
            await window.acquire()
            task = asyncio.create_task(one(delivery_id))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
        if failures:
            raise SystemExit(f"{len(failures)} publishes not confirmed: {failures[0]!r}")
    finally:
        await connection.close()
    print(f"published={args.count}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--amqp-url", required=True)
    parser.add_argument("--exchange", required=True)
    parser.add_argument("--routing-key", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--max-in-flight", type=int, default=1000)
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(publish(args))


if __name__ == "__main__":
    main()
