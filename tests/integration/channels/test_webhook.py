"""The webhook adapter against real HTTP servers on 127.0.0.1: request shape, signing,
classification, bounded reads, and destination safety (SSRF).

Destination-safety tests use addresses that must never receive traffic and assert the
refusal happens before any connection (aiohttp trace signals, a connection-counting
server, and the refusal reason itself, which a real connection attempt could not
produce).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime, parsedate_to_datetime
from ipaddress import ip_network
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver

from consumer.channels.base import OutcomeKind
from consumer.channels.webhook import PolicyResolver, WebhookChannel, WebhookConfig
from tests.support.http_harness import (
    KEY,
    PATH_SECRET,
    FakeDNS,
    Seen,
    Trace,
    assert_no_leak,
    make_request,
    raw_server,
    reply,
    serve,
)

SECRET_A = "whsec_" + base64.b64encode(b"secret-a-" + bytes(range(23))).decode()
SECRET_B = "whsec_" + base64.b64encode(b"secret-b-" + bytes(range(40, 63))).decode()
LOOPBACK = (ip_network("127.0.0.0/8"),)


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
        before = int(time.time())
        outcome = await channel.send(make_request(srv.url(f"/hook/{PATH_SECRET}"), payload))
        after = int(time.time())

    assert outcome.kind is OutcomeKind.ACCEPTED
    assert outcome.http_status == 200
    assert outcome.receipt == "http 200"
    assert outcome.response_excerpt == "ok"
    assert outcome.possibly_delivered is True
    [seen] = srv.seen
    assert seen.method == "POST"
    assert seen.path == f"/hook/{PATH_SECRET}"
    assert seen.headers["Content-Type"] == "application/json"
    assert seen.headers["Idempotency-Key"] == KEY
    assert seen.headers["webhook-id"] == KEY
    # Taken fresh for this attempt: the send's own second (or a later one if it was slow).
    assert before <= int(seen.headers["webhook-timestamp"]) <= after
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
        before = datetime.now(UTC)
        outcome = await ch.send(make_request(srv.url("/hook")))
        after = datetime.now(UTC)
    assert outcome.kind is OutcomeKind.THROTTLED
    assert outcome.retry_after_seconds is not None
    # Counted from the moment the answer was classified, which lies within the send.
    deadline = parsedate_to_datetime(when)
    assert (
        (deadline - after).total_seconds()
        <= outcome.retry_after_seconds
        <= (deadline - before).total_seconds()
    )


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


async def test_silent_server_is_cut_off_by_the_client_timeout() -> None:
    async with raw_server() as raw, webhook(timeout_seconds=0.5) as ch:
        outcome = await ch.send(make_request(f"http://127.0.0.1:{raw.port}/hook/{PATH_SECRET}"))
        # The server never answers: only the client's own timeout closes the connection,
        # and it does so before the channel itself is closed.
        async with asyncio.timeout(10):
            await raw.hung_up.wait()
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.error == "timeout"
    assert outcome.possibly_delivered is True
    assert raw.accepted == 1
    # The whole request had reached the server when the client gave up waiting.
    assert raw.received.startswith(f"POST /hook/{PATH_SECRET} HTTP/1.1\r\n".encode())
    assert raw.received.endswith(b'{"event":"reminder.due","n":1}')
    assert_no_leak(outcome)


async def test_connection_refused_is_retry(refused_port: int) -> None:
    async with webhook() as ch:
        outcome = await ch.send(make_request(f"http://127.0.0.1:{refused_port}/{PATH_SECRET}"))
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.error == "connection error"
    assert outcome.possibly_delivered is False
    assert_no_leak(outcome, str(refused_port))


async def test_payload_over_limit_is_rejected_without_request() -> None:
    async with serve(reply(200)) as srv, webhook(max_request_bytes=100) as ch:
        outcome = await ch.send(make_request(srv.url("/hook"), {"blob": "x" * 200}))
        small = await ch.send(make_request(srv.url("/hook"), {"blob": "x" * 10}))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.error == "payload too large"
    assert outcome.possibly_delivered is False
    assert small.kind is OutcomeKind.ACCEPTED
    assert len(srv.seen) == 1


async def test_unserializable_payload_rejected() -> None:
    async with webhook() as ch:
        outcome = await ch.send(make_request("http://127.0.0.1:9/", {"x": float("nan")}))
    assert outcome.kind is OutcomeKind.REJECTED
    assert outcome.error == "payload not json serializable"


async def test_response_excerpt_is_bounded() -> None:
    # How much is read is the shared plumbing's (test_http_plumbing.py) and the
    # endless-body test below shows it end to end.
    async with serve(reply(500, "e" * 10_000)) as srv, webhook() as ch:
        outcome = await ch.send(make_request(srv.url("/hook")))
    assert outcome.kind is OutcomeKind.RETRY
    assert outcome.response_excerpt == "e" * 100


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
    chunk, chunks = b"z" * 65536, 10_000  # 640 MB if the client kept reading
    written = 0
    stream_ended = asyncio.Event()

    async def stream(request: web.Request, _body: bytes) -> web.StreamResponse:
        nonlocal written
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        try:
            for _ in range(chunks):
                await response.write(chunk)
                written += len(chunk)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass
        finally:
            # Early only if the client hung up: a write fails, or aiohttp cancels the
            # handler when the connection is lost.
            stream_ended.set()
        return response

    async with serve(stream) as srv, webhook(max_response_bytes=1024) as ch:
        outcome = await ch.send(make_request(srv.url("/hook")))
        # With both the server and the channel still open, only the client's own
        # hang-up can end the stream.
        async with asyncio.timeout(10):
            await stream_ended.wait()
    assert outcome.kind is OutcomeKind.ACCEPTED
    assert outcome.response_excerpt == "z" * 100
    assert written < chunks * len(chunk)


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
    assert outcome.possibly_delivered is False
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
    assert outcome.possibly_delivered is False
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
