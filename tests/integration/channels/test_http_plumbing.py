"""The plumbing every HTTP adapter shares (consumer/channels/http.py), against real
servers on 127.0.0.1: the session's settings, the bounded POST, and the resolver hook
the webhook's address policy plugs into."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from consumer.channels import http
from tests.support.http_harness import FakeDNS, raw_server, reply, serve


@asynccontextmanager
async def shared(**overrides: Any) -> AsyncIterator[http.SharedSession]:
    values: dict[str, Any] = {
        "channel": "test",
        "timeout_seconds": 2.0,
        "connect_timeout_seconds": 1.0,
        "connection_limit": 4,
    }
    values.update(overrides)
    session = http.SharedSession(**values)
    try:
        yield session
    finally:
        await session.close()


async def test_session_carries_the_configured_limits_and_timeouts() -> None:
    async with shared(connection_limit=7) as default, shared(connection_limit_per_host=3) as per:
        session = default.get()
        assert session is default.get()  # one session per adapter
        assert session.timeout == aiohttp.ClientTimeout(total=2.0, sock_connect=1.0)
        assert isinstance(session.cookie_jar, aiohttp.DummyCookieJar)
        assert session.trust_env is False
        for channel_session, limits in ((session, (7, 7)), (per.get(), (4, 3))):
            connector = channel_session.connector
            assert isinstance(connector, aiohttp.TCPConnector)
            assert (connector.limit, connector.limit_per_host) == limits


async def test_cookies_set_by_one_answer_are_not_sent_with_the_next_request() -> None:
    async def set_cookie(request: web.Request, _body: bytes) -> web.StreamResponse:
        response = web.Response(status=200)
        response.set_cookie("session", "partner-a")
        return response

    async with serve(set_cookie) as srv, shared() as session:
        for _ in range(2):
            await http.post_bounded(session.get(), srv.url("/"), max_response_bytes=16)
    assert [seen.headers.get("Cookie") for seen in srv.seen] == [None, None]


@pytest.mark.parametrize("trust_env", [False, True])
async def test_environment_proxy_is_used_only_when_trusted(
    trust_env: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for scheme in ("http", "https", "all", "no"):
        monkeypatch.delenv(f"{scheme}_proxy", raising=False)
        monkeypatch.delenv(f"{scheme.upper()}_PROXY", raising=False)
    async with raw_server() as proxy, serve(reply(200, "direct")) as srv:
        url = srv.url("/hook")
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy.port}")
        async with shared(trust_env=trust_env, timeout_seconds=0.5) as session:
            try:
                result: http.HttpReply | BaseException = await http.post_bounded(
                    session.get(), url, max_response_bytes=16
                )
            except http.TRANSPORT_ERRORS as exc:
                result = exc
            if trust_env:
                # The silent proxy got the request, in proxy form, and the client gave up.
                async with asyncio.timeout(10):
                    await proxy.hung_up.wait()
    if trust_env:
        assert isinstance(result, TimeoutError)
        assert proxy.received.startswith(f"POST {url} HTTP/1.1\r\n".encode())
        assert srv.seen == []
    else:
        assert isinstance(result, http.HttpReply)
        assert result.body.data == b"direct"
        assert proxy.accepted == 0
        assert len(srv.seen) == 1


async def test_redirect_is_returned_not_followed() -> None:
    async with serve(reply(307, "", {"Location": "/elsewhere"})) as srv, shared() as session:
        answer = await http.post_bounded(session.get(), srv.url("/hook"), max_response_bytes=16)
    assert answer.status == 307
    assert answer.headers["Location"] == "/elsewhere"
    assert [seen.path for seen in srv.seen] == ["/hook"]


@pytest.mark.parametrize(
    ("size", "truncated"),
    [(0, False), (1023, False), (1024, False), (1025, True), (10_000, True)],
)
async def test_body_is_read_up_to_the_limit_and_says_whether_there_was_more(
    size: int, truncated: bool
) -> None:
    async with serve(reply(500, b"e" * size)) as srv, shared() as session:
        answer = await http.post_bounded(session.get(), srv.url("/"), max_response_bytes=1024)
    assert answer.status == 500
    assert answer.body.data == b"e" * min(size, 1024)
    assert answer.body.truncated is truncated
    assert answer.body.complete is True


class CountingDNS(FakeDNS):
    """FakeDNS that also records whether it was closed."""

    closed = 0

    async def close(self) -> None:
        self.closed += 1


async def test_resolver_is_built_in_the_loop_used_for_every_connection_and_closed() -> None:
    built: list[CountingDNS] = []

    def build() -> CountingDNS:
        dns = CountingDNS({"partner.test": [["127.0.0.1"]]})
        built.append(dns)
        return dns

    async def close_after(request: web.Request, _body: bytes) -> web.StreamResponse:
        response = web.Response(status=200)
        response.force_close()  # no keep-alive: the next request connects (and resolves) again
        return response

    async with serve(close_after) as srv:
        assert srv.server is not None
        session = http.SharedSession(
            channel="webhook",
            timeout_seconds=2.0,
            connect_timeout_seconds=1.0,
            connection_limit=4,
            resolver=build,
            dns_cache_ttl_seconds=None,
        )
        assert built == []  # nothing is built before the first send
        url = f"http://partner.test:{srv.server.port}/hook"
        for _ in range(2):
            answer = await http.post_bounded(session.get(), url, max_response_bytes=16)
            assert answer.status == 200
        await session.close()
        await session.close()
    [dns] = built
    assert dns.lookups == ["partner.test", "partner.test"]  # no DNS cache: asked per connection
    assert dns.closed == 1
    assert len(srv.seen) == 2
    with pytest.raises(RuntimeError, match="webhook channel is closed"):
        session.get()
