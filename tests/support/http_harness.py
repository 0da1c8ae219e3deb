"""Real HTTP and DNS stand-ins for the channel adapter tests.

Owns the servers the adapters talk to (an aiohttp server that records every
request, a raw TCP server that accepts and never answers, a loopback port that
refuses connections), a resolver with fixed answers that never sends a packet,
and a recorder of aiohttp client events. Everything listens on 127.0.0.1;
nothing mocks HTTP.

    async with serve(reply(200, "ok")) as srv:
        outcome = await channel.send(make_request(srv.url("/hook")))
    [seen] = srv.seen
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.test_utils import TestServer

from consumer.channels.base import Outcome, SendRequest

KEY = "reminder-42:2030-01-01T09:00:00Z"
PATH_SECRET = "tok_s3cr3t"  # must never appear in an Outcome


def make_request(destination: str, payload: dict[str, Any] | None = None) -> SendRequest:
    """Attempt 1 of delivery 42 with the key ``KEY``."""
    return SendRequest(
        delivery_id=42,
        idempotency_key=KEY,
        destination=destination,
        payload={"event": "reminder.due", "n": 1} if payload is None else payload,
        attempt=1,
        occurrence_at=datetime(2030, 1, 1, 9, 0, tzinfo=UTC),
    )


def assert_no_leak(outcome: Outcome, *needles: str) -> None:
    """Neither ``PATH_SECRET`` nor any of ``needles`` appears anywhere in the outcome."""
    text = repr(outcome)
    for needle in (PATH_SECRET, *needles):
        assert needle not in text


# --------------------------------------------------------------------------- recording server


@dataclass
class Seen:
    """One request as the server received it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


Responder = Callable[[web.Request, bytes], Awaitable[web.StreamResponse]]


@dataclass
class Recorder:
    """A real HTTP server that records each request and answers via ``respond``."""

    respond: Responder
    seen: list[Seen] = field(default_factory=list)
    server: TestServer | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(
            Seen(
                request.method,
                request.path,
                request.query_string,
                dict(request.headers),
                body,
            )
        )
        return await self.respond(request, body)

    def url(self, path: str = "/") -> str:
        assert self.server is not None
        return str(self.server.make_url(path))


@asynccontextmanager
async def serve(respond: Responder) -> AsyncIterator[Recorder]:
    """A recording server on a free loopback port, answering every path and method."""
    recorder = Recorder(respond)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    recorder.server = server
    try:
        yield recorder
    finally:
        await server.close()


def reply(
    status: int = 200,
    body: bytes | str = b"",
    headers: dict[str, str] | None = None,
) -> Responder:
    """Answer every request with this status, body and headers."""

    async def respond(request: web.Request, _body: bytes) -> web.StreamResponse:
        data = body.encode() if isinstance(body, str) else body
        return web.Response(status=status, body=data, headers=headers)

    return respond


def json_reply(status: int, obj: Any, headers: dict[str, str] | None = None) -> Responder:
    """Answer every request with ``obj`` as a JSON body."""
    return reply(status, json.dumps(obj), {"Content-Type": "application/json", **(headers or {})})


# --------------------------------------------------------------------------- raw servers


@dataclass
class RawServer:
    """Raw TCP server on 127.0.0.1 that counts connections and never answers.

    It keeps every byte it receives and sets ``hung_up`` when a client closes or
    resets its connection: with a server that never answers, only the client's
    own timeout can do that.
    """

    accepted: int = 0
    received: bytearray = field(default_factory=bytearray)
    hung_up: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None
    port: int = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            # Hold the connection open, never writing, until the client gives up.
            while chunk := await reader.read(65536):
                self.received += chunk
            self.hung_up.set()
        except ConnectionResetError:
            self.hung_up.set()
        finally:
            writer.close()


@asynccontextmanager
async def raw_server() -> AsyncIterator[RawServer]:
    """A silent server on a free loopback port."""
    raw = RawServer()
    raw.server = await asyncio.start_server(raw._handle, "127.0.0.1", 0)
    raw.port = raw.server.sockets[0].getsockname()[1]
    try:
        yield raw
    finally:
        raw.server.close()
        await raw.server.wait_closed()


@contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port that is bound but not listening: connecting is refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


# --------------------------------------------------------------------------- client side


@dataclass
class Trace:
    """Which aiohttp client events happened, to prove refusals precede connects."""

    events: list[str] = field(default_factory=list)

    def config(self) -> aiohttp.TraceConfig:
        config = aiohttp.TraceConfig()
        signals = {
            "request_start": config.on_request_start,
            "dns_start": config.on_dns_resolvehost_start,
            "connection_create_start": config.on_connection_create_start,
            "connection_create_end": config.on_connection_create_end,
            "connection_reuse": config.on_connection_reuseconn,
        }
        for name, signal in signals.items():
            signal.append(partial(self._record, name))
        return config

    async def _record(self, name: str, *_args: object) -> None:
        self.events.append(name)

    def count(self, name: str) -> int:
        return self.events.count(name)


class FakeDNS(AbstractResolver):
    """Answers fixed addresses per name, in turn per lookup; never sends a packet."""

    def __init__(self, answers: dict[str, list[list[str]]]) -> None:
        self.answers = {host: list(rounds) for host, rounds in answers.items()}
        self.lookups: list[str] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.lookups.append(host)
        rounds = self.answers[host]
        addresses = rounds.pop(0) if len(rounds) > 1 else rounds[0]
        return [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
            )
            for address in addresses
        ]

    async def close(self) -> None:
        return None
