"""A lean webhook receiver for the drain benchmark: a partner on another machine costs the
consumer's machine nothing, so this one costs as little as it can.

It speaks just enough HTTP/1.1 (keep-alive, ``Content-Length`` bodies) on a raw asyncio
protocol, verifies every Standard Webhooks signature against the secret in
``RELAY_WEBHOOK_SIGNING_SECRETS``, and counts logical events by ``Idempotency-Key`` the
way the demo partner does (``GET /stats`` returns the same JSON). About a fifth of the
demo partner's CPU per request, which matters on a 2-core machine where the receiver
competes with the consumer for the same cores.

    .venv/bin/python bench/receiver.py --port 8099
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import os
import signal
from collections import Counter
from typing import cast

import uvloop

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
_BAD = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n"


class Stats:
    def __init__(self, secret: str | None) -> None:
        raw = secret.removeprefix("whsec_") if secret else None
        self.key = base64.b64decode(raw + "=" * (-len(raw) % 4)) if raw else None
        self.accepted: set[str] = set()
        self.requests: Counter[str] = Counter()
        self.duplicates = 0
        self.bad_signatures = 0

    def verified(self, headers: dict[str, str], body: bytes) -> bool:
        if self.key is None:
            return True
        signed = f"{headers.get('webhook-id')}.{headers.get('webhook-timestamp')}.".encode()
        digest = hmac.new(self.key, signed + body, hashlib.sha256).digest()
        expected = "v1," + base64.b64encode(digest).decode()
        offered = headers.get("webhook-signature", "").split(" ")
        return any(hmac.compare_digest(expected, o) for o in offered)

    def json(self) -> bytes:
        return json.dumps(
            {
                "requests": sum(self.requests.values()),
                "logical_events": len(self.accepted),
                "duplicates": self.duplicates,
                "bad_signatures": self.bad_signatures,
                "by_path": dict(self.requests),
            }
        ).encode()


class Receiver(asyncio.Protocol):
    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            assert self.transport is not None
            self.transport.write(self.answer(head[0], headers, body))

    def answer(self, request_line: str, headers: dict[str, str], body: bytes) -> bytes:
        method, path, _ = request_line.split(" ", 2)
        if method == "GET" and path == "/stats":
            text = self.stats.json()
            return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text)
        self.stats.requests[path.rsplit("/", 1)[-1]] += 1
        if not self.stats.verified(headers, body):
            self.stats.bad_signatures += 1
            return _BAD
        key = headers.get("idempotency-key", "")
        if key in self.stats.accepted:
            self.stats.duplicates += 1
        else:
            self.stats.accepted.add(key)
        return _OK


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    secrets = os.environ.get("RELAY_WEBHOOK_SIGNING_SECRETS", "")
    stats = Stats(secrets.split(",")[0] or None)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Receiver(stats), "127.0.0.1", args.port)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with server:
        await stop.wait()


if __name__ == "__main__":
    uvloop.run(main())
