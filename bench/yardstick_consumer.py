"""A yardstick consumer for ``bench/yardstick_drain.py``: the least a process must do to
drain the relay's work queue into a webhook receiver, and nothing else.

Per message ``{"v": 1, "delivery_id": N}`` (``service/messages.py``), in batches of what
has arrived (at most ``--batch``): ONE ``SELECT`` of the rows' keys, destinations and
payloads, one signed POST each (Standard Webhooks, one shared aiohttp session), ONE
``UPDATE ... SET state = 'delivered'``, then ONE ``basic.ack multiple=True`` on the
batch's highest delivery tag, after every earlier batch's (tags only grow). No leases,
no attempt rows, no retries, no metrics: any failure ends the process (exit 1).

    python bench/yardstick_consumer.py --dsn postgresql://... --amqp-url amqp://... \\
        --queue bench-1234abcd.deliveries

The signing secret is the first of ``RELAY_WEBHOOK_SIGNING_SECRETS``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from datetime import UTC, datetime

import aio_pika
import aiohttp
import asyncpg
import uvloop
from aio_pika.abc import AbstractIncomingMessage
from standardwebhooks.webhooks import Webhook

SELECT = """
SELECT d.id, d.idempotency_key, coalesce(d.destination, r.destination) AS destination,
       coalesce(d.payload, r.payload) AS payload
FROM deliveries AS d LEFT JOIN reminders AS r ON r.id = d.reminder_id
WHERE d.id = ANY($1::bigint[])
"""
# 'delivered' needs attempts >= 1 and finished_at (the ledger's CHECKs)
UPDATE = """
UPDATE deliveries SET state = 'delivered', attempts = attempts + 1, last_status = 200,
    first_attempt_at = coalesce(first_attempt_at, now()), finished_at = now()
WHERE id = ANY($1::bigint[])
"""


class Yardstick:
    def __init__(self, args: argparse.Namespace, pool: asyncpg.Pool, http: aiohttp.ClientSession):
        self.batch_max = args.batch
        self.pool, self.http = pool, http
        self.signer = Webhook(os.environ["RELAY_WEBHOOK_SIGNING_SECRETS"].split(",")[0])
        self.inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        self.inbox.put_nowait(message)

    async def batches(self) -> None:
        """Group what has arrived, in arrival order; each batch acks after the one before."""
        previous: asyncio.Task[None] | None = None
        while True:
            batch = [await self.inbox.get()]
            while len(batch) < self.batch_max and not self.inbox.empty():
                batch.append(self.inbox.get_nowait())
            previous = asyncio.create_task(self.handle(batch, previous))
            previous.add_done_callback(self.check)

    def check(self, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None and not self.failed.done():
            self.failed.set_result(error)

    async def handle(
        self, batch: list[AbstractIncomingMessage], previous: asyncio.Task[None] | None
    ) -> None:
        ids = [json.loads(message.body)["delivery_id"] for message in batch]
        rows = await self.pool.fetch(SELECT, ids)
        if len(rows) != len(ids):
            raise RuntimeError(f"{len(ids) - len(rows)} of {len(ids)} delivery ids not found")
        await asyncio.gather(*(self.post(row) for row in rows))
        await self.pool.execute(UPDATE, ids)
        if previous is not None:
            await previous
        await batch[-1].ack(multiple=True)

    async def post(self, row: asyncpg.Record) -> None:
        # the relay's body: compact JSON of the payload, signed byte for byte
        body = json.dumps(json.loads(row["payload"]), separators=(",", ":"), ensure_ascii=False)
        key, now = row["idempotency_key"], int(time.time())
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": key,  # what bench/receiver.py counts logical events by
            "webhook-id": key,
            "webhook-timestamp": str(now),
            "webhook-signature": self.signer.sign(key, datetime.fromtimestamp(now, UTC), body),
        }
        async with self.http.post(row["destination"], data=body.encode(), headers=headers) as r:
            await r.read()
            if not 200 <= r.status < 300:
                raise RuntimeError(f"delivery {row['id']}: HTTP {r.status}")


async def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--amqp-url", required=True)
    parser.add_argument("--queue", required=True, help="the quorum work queue, <ns>.deliveries")
    parser.add_argument("--prefetch", type=int, default=500)
    parser.add_argument("--batch", type=int, default=200, help="most messages per batch")
    parser.add_argument("--connections", type=int, default=125, help="to one destination")
    parser.add_argument("--pool-size", type=int, default=10)
    args = parser.parse_args()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    connector = aiohttp.TCPConnector(limit=args.prefetch, limit_per_host=args.connections)
    async with (
        asyncpg.create_pool(args.dsn, min_size=1, max_size=args.pool_size) as pool,
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(10)) as http,
        await aio_pika.connect(args.amqp_url) as connection,
    ):
        yardstick = Yardstick(args, pool, http)
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=args.prefetch)
        queue = await channel.declare_queue(args.queue, passive=True)
        await queue.consume(yardstick.on_message)
        batches = asyncio.create_task(yardstick.batches())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([stopped, yardstick.failed], return_when=asyncio.FIRST_COMPLETED)
        batches.cancel()
        stopped.cancel()
        if yardstick.failed.done():
            print(f"yardstick failed: {yardstick.failed.result()!r}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(uvloop.run(main()))
