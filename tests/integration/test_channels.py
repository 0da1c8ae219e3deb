"""Channel adapters against real HTTP servers on 127.0.0.1.

Every server here is a real aiohttp (or raw asyncio) server on a free loopback
port; nothing mocks HTTP. Destination-safety tests use addresses that must never
receive traffic and assert the refusal happens before any connection (aiohttp
trace signals, a connection-counting server, and the refusal reason itself,
which a real connection attempt could not produce).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from functools import partial
from ipaddress import ip_network
from typing import Any
from urllib.parse import parse_qs

import aiohttp
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.test_utils import TestServer
from pydantic import SecretStr

from consumer.channels.base import Outcome, OutcomeKind, SendRequest
from consumer.channels.email import EmailChannel, EmailConfig
from consumer.channels.sms import SmsChannel, SmsConfig
from consumer.channels.webhook import PolicyResolver, WebhookChannel, WebhookConfig

SECRET_A = "whsec_" + base64.b64encode(b"secret-a-" + bytes(range(23))).decode()
SECRET_B = "whsec_" + base64.b64encode(b"secret-b-" + bytes(range(40, 63))).decode()
LOOPBACK = (ip_network("127.0.0.0/8"),)
KEY = "reminder-42:2030-01-01T09:00:00Z"
PATH_SECRET = "tok_s3cr3t"  # must never appear in an Outcome


def make_request(destination: str, payload: dict[str, Any] | None = None) -> SendRequest:
    return SendRequest(
        delivery_id=42,
        idempotency_key=KEY,
        destination=destination,
        payload={"event": "reminder.due", "n": 1} if payload is None else payload,
        attempt=1,
        occurrence_at=datetime(2030, 1, 1, 9, 0, tzinfo=UTC),
    )


def assert_no_leak(outcome: Outcome, *needles: str) -> None:
    text = repr(outcome)
    for needle in (PATH_SECRET, *needles):
        assert needle not in text


# --------------------------------------------------------------------------- servers


@dataclass
class Seen:
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
    async def respond(request: web.Request, _body: bytes) -> web.StreamResponse:
        data = body.encode() if isinstance(body, str) else body
        return web.Response(status=status, body=data, headers=headers)

    return respond


def json_reply(status: int, obj: Any, headers: dict[str, str] | None = None) -> Responder:
    return reply(status, json.dumps(obj), {"Content-Type": "application/json", **(headers or {})})


@dataclass
class RawServer:
    """Raw TCP server on 127.0.0.1 that counts connections and never answers."""

    accepted: int = 0
    server: asyncio.Server | None = None
    port: int = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            await reader.read()  # hold the connection open until the client gives up
        finally:
            writer.close()


@asynccontextmanager
async def raw_server() -> AsyncIterator[RawServer]:
    raw = RawServer()
    raw.server = await asyncio.start_server(raw._handle, "127.0.0.1", 0)
    raw.port = raw.server.sockets[0].getsockname()[1]
    try:
        yield raw
    finally:
        raw.server.close()
        await raw.server.wait_closed()


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A loopback port that is bound but not listening: connecting is refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


# --------------------------------------------------------------------------- tracing


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


# --------------------------------------------------------------------------- webhook


def webhook_config(**overrides: Any) -> WebhookConfig:
    values: dict[str, Any] = {
        "signing_secrets": (SECRET_A,),
        "timeout_seconds": 2.0,
        "connect_timeout_seconds": 1.0,
        "allow_networks": LOOPBACK,
        "max_request_bytes": 4096,
        "max_response_bytes": 2048,
        "max_response_excerpt_bytes": 100,
    }
    values.update(overrides)
    return WebhookConfig(**values)


@asynccontextmanager
async def webhook(
    *,
    resolver: AbstractResolver | None = None,
    trace: Trace | None = None,
    **overrides: Any,
) -> AsyncIterator[WebhookChannel]:
    channel = WebhookChannel(
        webhook_config(**overrides),
        resolver=resolver,
        trace_configs=[trace.config()] if trace else (),
    )
    try:
        yield channel
    finally:
        await channel.close()


def standard_webhooks_signature(secret: str, msg_id: str, timestamp: str, body: bytes) -> str:
    """Independent implementation of the Standard Webhooks v1 signature."""
    key = base64.b64decode(secret.split("_", 1)[1])
    signed = msg_id.encode() + b"." + timestamp.encode() + b"." + body
    return base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signature_matches(secret: str, seen: Seen, entry: str) -> bool:
    version, _, sig = entry.partition(",")
    expected = standard_webhooks_signature(
        secret, seen.headers["webhook-id"], seen.headers["webhook-timestamp"], seen.body
    )
    return version == "v1" and hmac.compare_digest(sig, expected)


async def test_200_accepted_with_request_shape() -> None:
    async with serve(reply(200, "ok")) as srv, webhook() as channel:
        payload = {"event": "reminder.due", "name": "Zoë", "n": 3}
        outcome = await channel.send(make_request(srv.url(f"/hook/{PATH_SECRET}"), payload))

    assert outcome.kind is OutcomeKind.ACCEPTED
    assert outcome.http_status == 200
    assert outcome.receipt == "http 200"
    assert outcome.response_excerpt == "ok"
    [seen] = srv.seen
    assert seen.method == "POST"
    assert seen.path == f"/hook/{PATH_SECRET}"
    assert seen.headers["Content-Type"] == "application/json"
    assert seen.headers["Idempotency-Key"] == KEY
    assert seen.headers["webhook-id"] == KEY
    assert abs(int(seen.headers["webhook-timestamp"]) - time.time()) < 5
    assert json.loads(seen.body) == payload
    assert "Cookie" not in seen.headers
    assert_no_leak(outcome)


async def test_202_receipt_with_clean_request_id() -> None:
    async with serve(reply(202, "", {"X-Request-Id": "req_abc-123"})) as srv, webhook() as ch:
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.receipt == "http 202 x-request-id=req_abc-123"


async def test_signature_verifies_with_independent_implementation() -> None:
    async with serve(reply(204)) as srv, webhook() as channel:
        outcome = await channel.send(make_request(srv.url("/hook")))
    assert outcome.kind is OutcomeKind.ACCEPTED
    [seen] = srv.seen
    entries = seen.headers["webhook-signature"].split(" ")
    assert len(entries) == 1
    assert signature_matches(SECRET_A, seen, entries[0])
    assert not signature_matches(SECRET_B, seen, entries[0])


async def test_rotation_sends_one_signature_per_secret() -> None:
    async with serve(reply(200)) as srv, webhook(signing_secrets=(SECRET_A, SECRET_B)) as ch:
        await ch.send(make_request(srv.url("/hook")))
    [seen] = srv.seen
    first, second = seen.headers["webhook-signature"].split(" ")
    assert signature_matches(SECRET_A, seen, first)
    assert signature_matches(SECRET_B, seen, second)
    assert not signature_matches(SECRET_A, seen, second)
    assert not signature_matches(SECRET_B, seen, first)


async def test_retry_reuses_key_with_fresh_signature() -> None:
    async with serve(reply(503)) as srv, webhook() as ch:
        await ch.send(make_request(srv.url("/hook")))
        await ch.send(make_request(srv.url("/hook")))
    first, second = srv.seen
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == KEY
    assert first.headers["Idempotency-Key"] == second.headers["Idempotency-Key"] == KEY
    for seen in (first, second):
        assert signature_matches(SECRET_A, seen, seen.headers["webhook-signature"])


async def test_no_secrets_means_unsigned() -> None:
    async with serve(reply(200)) as srv, webhook(signing_secrets=()) as ch:
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.kind is OutcomeKind.ACCEPTED
    [seen] = srv.seen
    assert "webhook-signature" not in seen.headers
    assert seen.headers["webhook-id"] == KEY


async def test_redirect_is_rejected_and_target_not_requested() -> None:
    async with serve(reply(301, "", {"Location": "/elsewhere"})) as srv, webhook() as ch:
        outcome = await ch.send(make_request(srv.url(f"/hook/{PATH_SECRET}")))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.http_status == 301
    assert outcome.error == "redirect not followed"
    assert [s.path for s in srv.seen] == [f"/hook/{PATH_SECRET}"]
    assert_no_leak(outcome, "/elsewhere")


async def test_redirect_to_private_address_is_not_followed() -> None:
    trace = Trace()
    async with (
        serve(reply(302, "", {"Location": "http://10.0.0.1/admin"})) as srv,
        webhook(trace=trace) as ch,
    ):
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.error == "redirect not followed"
    assert len(srv.seen) == 1
    # Exactly one request and one connection: the one to the loopback server.
    assert trace.count("request_start") == 1
    assert trace.count("connection_create_end") == 1
    assert_no_leak(outcome, "10.0.0.1")


async def test_410_disables_destination() -> None:
    async with serve(reply(410, "gone")) as srv, webhook() as ch:
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.disable_destination is True
    assert outcome.error == "410 gone: destination disabled"
    assert outcome.http_status == 410


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_other_4xx_rejected(status: int) -> None:
    async with serve(reply(status, "nope")) as srv, webhook() as ch:
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.error == f"http {status}"
    assert outcome.disable_destination is False
    assert outcome.response_excerpt == "nope"


async def test_429_retry_after_seconds() -> None:
    async with serve(reply(429, "", {"Retry-After": "7"})) as srv, webhook() as ch:
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.kind is OutcomeKind.THROTTLED
    assert outcome.error == "http 429"
    assert outcome.retry_after_seconds == 7.0


async def test_429_retry_after_http_date() -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True)
    async with serve(reply(429, "", {"Retry-After": when})) as srv, webhook() as ch:
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.kind is OutcomeKind.THROTTLED
    assert outcome.retry_after_seconds is not None
    assert 110 <= outcome.retry_after_seconds <= 120


async def test_503_retry_with_retry_after() -> None:
    async with serve(reply(503, "busy", {"Retry-After": "30"})) as srv, webhook() as ch:
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.error == "http 503"
    assert outcome.retry_after_seconds == 30.0


@pytest.mark.parametrize("status", [408, 425, 500, 502])
async def test_retryable_statuses(status: int) -> None:
    async with serve(reply(status)) as srv, webhook() as ch:
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.error == f"http {status}"
    assert outcome.retry_after_seconds is None


async def test_silent_server_times_out_within_configured_timeout() -> None:
    async with raw_server() as raw, webhook(timeout_seconds=0.5) as ch:
        started = time.monotonic()
        outcome = await ch.send(make_request(f"http://127.0.0.1:{raw.port}/hook/{PATH_SECRET}"))
        elapsed = time.monotonic() - started
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.error == "timeout"
    assert outcome.extra["possibly_delivered"] == "true"
    assert raw.accepted == 1
    assert 0.4 <= elapsed < 1.5
    assert_no_leak(outcome)


async def test_connection_refused_is_retry(refused_port: int) -> None:
    async with webhook() as ch:
        outcome = await ch.send(make_request(f"http://127.0.0.1:{refused_port}/{PATH_SECRET}"))
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.error == "connection error"
    assert outcome.extra["possibly_delivered"] == "false"
    assert_no_leak(outcome, str(refused_port))


async def test_payload_over_limit_is_rejected_without_request() -> None:
    async with serve(reply(200)) as srv, webhook(max_request_bytes=100) as ch:
        outcome = await ch.send(make_request(srv.url("/hook"), {"blob": "x" * 200}))
        small = await ch.send(make_request(srv.url("/hook"), {"blob": "x" * 10}))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.error == "payload too large"
    assert small.kind is OutcomeKind.ACCEPTED
    assert len(srv.seen) == 1


async def test_unserializable_payload_rejected() -> None:
    async with webhook() as ch:
        outcome = await ch.send(make_request("http://127.0.0.1:9/", {"x": float("nan")}))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.error == "payload not json serializable"


async def test_response_excerpt_and_read_are_bounded() -> None:
    async with serve(reply(500, "e" * 10_000)) as srv, webhook() as ch:
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.response_excerpt == "e" * 100
    assert outcome.extra["response_truncated"] == "true"


async def test_excerpt_cut_inside_multibyte_character_is_replaced() -> None:
    async with (
        serve(reply(400, "é" * 100)) as srv,
        webhook(max_response_excerpt_bytes=51) as ch,
    ):
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.response_excerpt is not None
    assert outcome.response_excerpt == "é" * 25 + "\ufffd"
    assert len(outcome.response_excerpt.encode()) <= 51 + 2  # U+FFFD is 3 bytes for 1


async def test_endless_response_is_not_read_past_the_limit() -> None:
    async def stream(request: web.Request, _body: bytes) -> web.StreamResponse:
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        try:
            for _ in range(10_000):  # up to 640 MB if the client kept reading
                await response.write(b"z" * 65536)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass
        return response

    async with serve(stream) as srv, webhook(max_response_bytes=1024) as ch:
        started = time.monotonic()
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.kind is OutcomeKind.ACCEPTED
    assert outcome.extra["response_truncated"] == "true"
    assert outcome.response_excerpt == "z" * 100
    assert time.monotonic() - started < 2


# --------------------------------------------------------------------------- SSRF


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://10.0.0.1/hook", "ssrf: private address"),
        ("http://172.16.5.4/hook", "ssrf: private address"),
        ("http://192.168.1.1/hook", "ssrf: private address"),
        ("http://169.254.169.254/latest/meta-data/", "ssrf: link-local address"),
        ("http://224.0.0.1/hook", "ssrf: multicast address"),
        ("http://100.64.0.1/hook", "ssrf: shared address (cgnat)"),
        ("http://240.0.0.1/hook", "ssrf: reserved address"),
        ("http://[::1]:8080/hook", "ssrf: loopback address"),
        ("http://[fd00::1]/hook", "ssrf: private address"),
        ("http://[fe80::1]/hook", "ssrf: link-local address"),
        ("http://[::ffff:127.0.0.1]/hook", "ssrf: loopback address (ipv4-mapped)"),
        ("http://[::ffff:10.0.0.1]/hook", "ssrf: private address (ipv4-mapped)"),
        ("http://0.0.0.0:8080/hook", "ssrf: unspecified address"),
        ("http://2130706433/hook", "url: non-canonical numeric host"),
        ("http://0x7f.1/hook", "url: non-canonical numeric host"),
        ("http://user:pw@example.com/hook", "url: userinfo not allowed"),
        ("file:///etc/passwd", "url: scheme must be http or https"),
        ("gopher://example.com/", "url: scheme must be http or https"),
    ],
)
async def test_literal_non_public_destinations_refused_before_connecting(
    url: str, reason: str
) -> None:
    trace = Trace()
    async with webhook(allow_networks=(), trace=trace) as ch:
        outcome = await ch.send(make_request(url))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.error == reason
    assert outcome.http_status is None
    # Refused before aiohttp even started a request: no resolve, no connect.
    assert trace.events == []
    assert_no_leak(outcome, "/hook", "meta-data")


async def test_loopback_refused_without_allowlist_and_server_never_connected() -> None:
    async with raw_server() as raw:
        trace = Trace()
        async with webhook(allow_networks=(), trace=trace) as ch:
            by_ip = await ch.send(make_request(f"http://127.0.0.1:{raw.port}/{PATH_SECRET}"))
            by_name = await ch.send(make_request(f"http://localhost:{raw.port}/{PATH_SECRET}"))
        assert raw.accepted == 0
    assert by_ip.kind is OutcomeKind.REJECTED
    assert by_ip.error == "ssrf: loopback address"
    # "localhost" went through the real resolver, which refused it at connect time.
    assert by_name.kind is OutcomeKind.REJECTED
    assert by_name.error == "ssrf: loopback address"
    assert trace.count("dns_start") == 1
    assert trace.count("connection_create_end") == 0
    assert_no_leak(by_name)


@pytest.mark.parametrize(
    ("answers", "reason"),
    [
        (["10.0.0.1"], "ssrf: private address"),
        (["169.254.169.254"], "ssrf: link-local address"),
        (["93.184.216.34", "10.1.2.3"], "ssrf: private address"),  # ANY refused address
        (["2606:2800:220:1::1", "::1"], "ssrf: loopback address"),
        (["::ffff:192.168.0.10"], "ssrf: private address (ipv4-mapped)"),
        (["0.0.0.0"], "ssrf: unspecified address"),
    ],
)
async def test_public_looking_name_resolving_to_non_public_is_refused_at_connect(
    answers: list[str], reason: str
) -> None:
    dns = FakeDNS({"hooks.partner-example.com": [answers]})
    trace = Trace()
    async with webhook(allow_networks=(), resolver=dns, trace=trace) as ch:
        outcome = await ch.send(make_request(f"https://hooks.partner-example.com/{PATH_SECRET}"))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.error == reason
    assert dns.lookups == ["hooks.partner-example.com"]
    assert trace.count("connection_create_end") == 0
    assert_no_leak(outcome, "partner-example")


async def test_public_answer_passes_the_resolver_without_connecting() -> None:
    dns = FakeDNS({"hooks.partner-example.com": [["93.184.216.34", "2606:2800:220:1::1"]]})
    resolver = PolicyResolver(dns, (), owns_inner=False)
    results = await resolver.resolve("hooks.partner-example.com", 443, socket.AF_UNSPEC)
    assert [r["host"] for r in results] == ["93.184.216.34", "2606:2800:220:1::1"]


async def test_dns_rebinding_is_caught_on_the_next_connection() -> None:
    async def close_after(request: web.Request, _body: bytes) -> web.StreamResponse:
        response = web.Response(status=200, text="ok")
        response.force_close()  # no keep-alive: the next send must connect (and resolve) again
        return response

    async with serve(close_after) as srv:
        assert srv.server is not None
        port = srv.server.port
        dns = FakeDNS({"rebind.partner-example.com": [["127.0.0.1"], ["10.0.0.1"]]})
        async with webhook(resolver=dns, dns_cache_ttl_seconds=None) as ch:
            url = f"http://rebind.partner-example.com:{port}/hook"
            first = await ch.send(make_request(url))
            second = await ch.send(make_request(url))
    assert first.kind is OutcomeKind.ACCEPTED  # 127.0.0.0/8 is allowlisted here
    assert second.kind is OutcomeKind.REJECTED
    assert second.error == "ssrf: private address"
    assert len(srv.seen) == 1
    assert dns.lookups == ["rebind.partner-example.com"] * 2


async def test_allowlist_admits_listed_network_only() -> None:
    dns = FakeDNS({"internal.partner-example.com": [["10.20.0.5"]]})
    async with serve(reply(200)) as srv:
        assert srv.server is not None
        async with webhook(allow_networks=(ip_network("127.0.0.1/32"),), resolver=dns) as ch:
            allowed = await ch.send(make_request(srv.url("/hook")))
            refused = await ch.send(make_request("http://internal.partner-example.com/hook"))
    assert allowed.kind is OutcomeKind.ACCEPTED
    assert refused.error == "ssrf: private address"


def test_webhook_config_validates_and_hides_secrets() -> None:
    config = webhook_config(signing_secrets=(SECRET_A, SECRET_B))
    assert SECRET_A not in repr(config)
    with pytest.raises(ValueError, match=r"signing_secrets\[0\] is not valid base64") as info:
        webhook_config(signing_secrets=("whsec_not base64!!",))
    assert "not base64!!" not in str(info.value)
    with pytest.raises(ValueError, match="max_response_excerpt_bytes"):
        webhook_config(max_response_excerpt_bytes=10_000)
    with pytest.raises(ValueError, match="timeout_seconds"):
        webhook_config(timeout_seconds=0)


async def test_send_after_close_raises() -> None:
    channel = WebhookChannel(webhook_config())
    await channel.close()
    await channel.close()
    with pytest.raises(RuntimeError):
        await channel.send(make_request("http://127.0.0.1:9/"))


# --------------------------------------------------------------------------- email

API_KEY = "re_test_4f9b2c"
RECIPIENT = "ada@example.org"


@asynccontextmanager
async def email_channel(srv: Recorder, **overrides: Any) -> AsyncIterator[EmailChannel]:
    values: dict[str, Any] = {
        "base_url": srv.url("/"),
        "api_key": SecretStr(API_KEY),
        "sender": "Reminders <reminders@relay.example>",
        "timeout_seconds": 2.0,
    }
    values.update(overrides)
    channel = EmailChannel(EmailConfig(**values))
    try:
        yield channel
    finally:
        await channel.close()


EMAIL_PAYLOAD = {"subject": "Dentist at 9:00", "text": "See you tomorrow.", "html": "<p>See</p>"}


async def test_email_request_shape_and_receipt() -> None:
    async with (
        serve(json_reply(200, {"id": "49a3999c-0ce1-4ea6-ab68-afcd6dc2e794"})) as srv,
        email_channel(srv) as ch,
    ):
        outcome = await ch.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
    assert outcome.kind is OutcomeKind.ACCEPTED
    assert outcome.receipt == "49a3999c-0ce1-4ea6-ab68-afcd6dc2e794"
    assert outcome.response_excerpt is None
    [seen] = srv.seen
    assert seen.method == "POST"
    assert seen.path == "/emails"
    assert seen.headers["Authorization"] == f"Bearer {API_KEY}"
    assert seen.headers["Idempotency-Key"] == KEY
    assert seen.headers["Content-Type"] == "application/json"
    assert json.loads(seen.body) == {
        "from": "Reminders <reminders@relay.example>",
        "to": [RECIPIENT],
        "subject": "Dentist at 9:00",
        "text": "See you tomorrow.",
        "html": "<p>See</p>",
    }
    assert_no_leak(outcome, RECIPIENT, API_KEY)


async def test_email_html_is_optional_and_api_key_may_be_str() -> None:
    payload = {"subject": "s", "text": "t"}
    async with serve(json_reply(200, {"id": "e1"})) as srv, email_channel(srv, api_key="k") as ch:
        outcome = await ch.send(make_request(RECIPIENT, payload))
    assert outcome.receipt == "e1"
    assert "html" not in json.loads(srv.seen[0].body)
    assert srv.seen[0].headers["Authorization"] == "Bearer k"


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"text": "t"}, "payload missing 'subject'"),
        ({"subject": "s"}, "payload missing 'text'"),
        ({"subject": "a\r\nBcc: x@y.z", "text": "t"}, "payload invalid 'subject'"),
        ({"subject": "s", "text": 5}, "payload invalid 'text'"),
        ({"subject": "s", "text": "t", "html": ["x"]}, "payload invalid 'html'"),
    ],
)
async def test_email_payload_problems_rejected_without_request(
    payload: dict[str, Any], error: str
) -> None:
    async with serve(json_reply(200, {"id": "x"})) as srv, email_channel(srv) as ch:
        outcome = await ch.send(make_request(RECIPIENT, payload))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.error == error
    assert srv.seen == []


async def test_email_invalid_recipient_rejected() -> None:
    async with serve(json_reply(200, {"id": "x"})) as srv, email_channel(srv) as ch:
        outcome = await ch.send(make_request("a@b.c, evil@x.y", EMAIL_PAYLOAD))
    assert outcome.error == "invalid recipient address"
    assert srv.seen == []


async def test_email_provider_error_reported_by_name_only() -> None:
    body = {
        "statusCode": 403,
        "name": "validation_error",
        "message": f"You can only send testing emails to your own email address ({RECIPIENT}).",
    }
    async with serve(json_reply(403, body)) as srv, email_channel(srv) as ch:
        outcome = await ch.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.http_status == 403
    assert outcome.error == "resend validation_error"
    assert outcome.extra["provider_error"] == "validation_error"
    assert_no_leak(outcome, RECIPIENT, "testing emails")


async def test_email_429_uses_retry_after_then_ratelimit_reset() -> None:
    limited = {"statusCode": 429, "name": "rate_limit_exceeded", "message": "Too many"}
    async with (
        serve(json_reply(429, limited, {"retry-after": "2"})) as srv,
        email_channel(srv) as ch,
    ):
        with_retry_after = await ch.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
    async with (
        serve(json_reply(429, limited, {"ratelimit-reset": "5"})) as srv,
        email_channel(srv) as ch,
    ):
        with_reset = await ch.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
    assert with_retry_after.kind is OutcomeKind.THROTTLED
    assert with_retry_after.retry_after_seconds == 2.0
    assert with_retry_after.error == "resend rate_limit_exceeded"
    assert with_reset.kind is OutcomeKind.THROTTLED
    assert with_reset.retry_after_seconds == 5.0


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("concurrent_idempotent_requests", OutcomeKind.RETRY),
        ("invalid_idempotent_request", OutcomeKind.REJECTED),
    ],
)
async def test_email_409_idempotency_conflicts(name: str, kind: OutcomeKind) -> None:
    body = {"statusCode": 409, "name": name, "message": "..."}
    async with serve(json_reply(409, body)) as srv, email_channel(srv) as ch:
        outcome = await ch.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
    assert outcome.kind is kind
    assert outcome.error == f"resend {name}"


async def test_email_5xx_retry_and_gateway_page_excerpted() -> None:
    async with serve(reply(502, "<html>Bad Gateway</html>" + "x" * 2000)) as srv:
        async with email_channel(srv, max_response_excerpt_bytes=24) as ch:
            outcome = await ch.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.error == "http 502"
    assert outcome.response_excerpt == "<html>Bad Gateway</html>"


async def test_email_timeout_is_retry() -> None:
    async with raw_server() as raw:
        config = EmailConfig(
            base_url=f"http://127.0.0.1:{raw.port}",
            api_key=API_KEY,
            sender="r@relay.example",
            timeout_seconds=0.5,
        )
        channel = EmailChannel(config)
        try:
            outcome = await channel.send(make_request(RECIPIENT, EMAIL_PAYLOAD))
        finally:
            await channel.close()
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.error == "timeout"
    assert_no_leak(outcome, API_KEY, RECIPIENT)


def test_email_config_hides_key() -> None:
    config = EmailConfig(base_url="https://api.resend.com/", api_key=API_KEY, sender="a@b.c")
    assert API_KEY not in repr(config)
    assert config.base_url == "https://api.resend.com"
    with pytest.raises(ValueError, match="base_url"):
        EmailConfig(base_url="ftp://x", api_key=API_KEY, sender="a@b.c")


# --------------------------------------------------------------------------- sms

ACCOUNT_SID = "AC" + "0123456789abcdef" * 2
AUTH_TOKEN = "twilio-auth-token-7c1d"
FROM = "+15005550006"
TO = "+14155550123"
SERVICE_SID = "MG" + "fedcba9876543210" * 2


@asynccontextmanager
async def sms_channel(srv: Recorder, **overrides: Any) -> AsyncIterator[SmsChannel]:
    values: dict[str, Any] = {
        "base_url": srv.url("/"),
        "account_sid": ACCOUNT_SID,
        "auth_token": SecretStr(AUTH_TOKEN),
        "from_number": FROM,
        "timeout_seconds": 2.0,
    }
    values.update(overrides)
    channel = SmsChannel(SmsConfig(**values))
    try:
        yield channel
    finally:
        await channel.close()


def twilio_created(sid: str = "SM" + "a" * 32) -> Responder:
    return json_reply(201, {"sid": sid, "status": "queued", "to": TO, "body": "Dentist at 9"})


async def test_sms_request_shape_and_receipt() -> None:
    async with serve(twilio_created()) as srv, sms_channel(srv) as ch:
        outcome = await ch.send(make_request(TO, {"body": "Dentist at 9 & bring card ✓"}))
    assert outcome.kind is OutcomeKind.ACCEPTED
    assert outcome.http_status == 201
    assert outcome.receipt == "SM" + "a" * 32
    assert outcome.extra == {"provider_status": "queued"}
    assert outcome.response_excerpt is None
    [seen] = srv.seen
    assert seen.method == "POST"
    assert seen.path == f"/2010-04-01/Accounts/{ACCOUNT_SID}/Messages.json"
    assert seen.headers["Content-Type"] == "application/x-www-form-urlencoded"
    scheme, _, token = seen.headers["Authorization"].partition(" ")
    assert scheme == "Basic"
    assert base64.b64decode(token).decode() == f"{ACCOUNT_SID}:{AUTH_TOKEN}"
    form = {k: v[0] for k, v in parse_qs(seen.body.decode(), strict_parsing=True).items()}
    assert form == {"To": TO, "From": FROM, "Body": "Dentist at 9 & bring card ✓"}
    assert seen.headers["Idempotency-Key"] == KEY
    assert_no_leak(outcome, TO, AUTH_TOKEN, "Dentist")


async def test_sms_messaging_service_instead_of_from() -> None:
    async with (
        serve(twilio_created()) as srv,
        sms_channel(srv, from_number=None, messaging_service_sid=SERVICE_SID) as ch,
    ):
        outcome = await ch.send(make_request(TO, {"body": "hi"}))
    assert outcome.kind is OutcomeKind.ACCEPTED
    form = parse_qs(srv.seen[0].body.decode())
    assert form["MessagingServiceSid"] == [SERVICE_SID]
    assert "From" not in form


async def test_sms_twilio_error_code_rejected_without_message() -> None:
    body = {
        "code": 21211,
        "message": f"The 'To' number {TO} is not a valid phone number.",
        "more_info": "https://www.twilio.com/docs/errors/21211",
        "status": 400,
    }
    async with serve(json_reply(400, body)) as srv, sms_channel(srv) as ch:
        outcome = await ch.send(make_request(TO, {"body": "hi"}))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.http_status == 400
    assert outcome.error == "twilio 21211"
    assert outcome.extra["provider_error"] == "21211"
    assert_no_leak(outcome, TO, "valid phone")


async def test_sms_429_throttled_and_5xx_retry() -> None:
    busy = {"code": 20429, "message": "Too Many Requests", "status": 429}
    async with serve(json_reply(429, busy, {"Retry-After": "3"})) as srv, sms_channel(srv) as ch:
        throttled = await ch.send(make_request(TO, {"body": "hi"}))
    async with serve(reply(503, "unavailable")) as srv, sms_channel(srv) as ch:
        retry = await ch.send(make_request(TO, {"body": "hi"}))
    assert throttled.kind is OutcomeKind.THROTTLED
    assert throttled.error == "twilio 20429"
    assert throttled.retry_after_seconds == 3.0
    assert retry.kind is OutcomeKind.RETRY
    assert retry.error == "http 503"


@pytest.mark.parametrize(
    ("destination", "payload", "error"),
    [
        (TO, {}, "payload missing 'body'"),
        (TO, {"body": ""}, "payload invalid 'body'"),
        (TO, {"body": 12}, "payload invalid 'body'"),
        (TO, {"body": "x" * 1601}, "payload too large"),
        (TO, {"body": "😀" * 801}, "payload too large"),  # 1602 UTF-16 units
        ("4155550123", {"body": "hi"}, "invalid recipient number"),
        ("+1415555\n0123", {"body": "hi"}, "invalid recipient number"),
    ],
)
async def test_sms_request_problems_rejected_without_request(
    destination: str, payload: dict[str, Any], error: str
) -> None:
    async with serve(twilio_created()) as srv, sms_channel(srv) as ch:
        outcome = await ch.send(make_request(destination, payload))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.error == error
    assert srv.seen == []


async def test_sms_body_at_limit_is_sent() -> None:
    async with serve(twilio_created()) as srv, sms_channel(srv) as ch:
        outcome = await ch.send(make_request(TO, {"body": "x" * 1600}))
    assert outcome.kind is OutcomeKind.ACCEPTED


async def test_sms_connection_refused_is_retry_not_delivered(refused_port: int) -> None:
    config = SmsConfig(
        base_url=f"http://127.0.0.1:{refused_port}",
        account_sid=ACCOUNT_SID,
        auth_token=AUTH_TOKEN,
        from_number=FROM,
    )
    channel = SmsChannel(config)
    try:
        outcome = await channel.send(make_request(TO, {"body": "hi"}))
    finally:
        await channel.close()
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.error == "connection error"
    assert outcome.extra["possibly_delivered"] == "false"
    assert_no_leak(outcome, AUTH_TOKEN, ACCOUNT_SID)


def test_sms_config_validation() -> None:
    config = SmsConfig(account_sid=ACCOUNT_SID, auth_token=AUTH_TOKEN, from_number=FROM)
    assert AUTH_TOKEN not in repr(config)
    with pytest.raises(ValueError, match="exactly one"):
        SmsConfig(account_sid=ACCOUNT_SID, auth_token=AUTH_TOKEN)
    with pytest.raises(ValueError, match="exactly one"):
        SmsConfig(
            account_sid=ACCOUNT_SID,
            auth_token=AUTH_TOKEN,
            from_number=FROM,
            messaging_service_sid=SERVICE_SID,
        )
    with pytest.raises(ValueError, match="account_sid"):
        SmsConfig(account_sid="AC123/../x", auth_token=AUTH_TOKEN, from_number=FROM)
