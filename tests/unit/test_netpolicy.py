"""Destination safety policy: address classification, allowlists, URL checks."""

from __future__ import annotations

from ipaddress import ip_address, ip_network

import pytest

from service.netpolicy import (
    DestinationRefused,
    address_problem,
    check_addresses,
    host_problem,
    parse_networks,
    resolve_and_check,
    url_problem,
)


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "ssrf: loopback address"),
        ("127.255.0.9", "ssrf: loopback address"),
        ("10.0.0.1", "ssrf: private address"),
        ("172.31.255.254", "ssrf: private address"),
        ("192.168.10.1", "ssrf: private address"),
        ("100.64.0.1", "ssrf: shared address (cgnat)"),
        ("100.127.255.254", "ssrf: shared address (cgnat)"),
        ("169.254.169.254", "ssrf: link-local address"),
        ("224.0.0.1", "ssrf: multicast address"),
        ("239.255.255.250", "ssrf: multicast address"),
        ("240.0.0.1", "ssrf: reserved address"),
        ("255.255.255.255", "ssrf: reserved address"),
        ("0.0.0.0", "ssrf: unspecified address"),
        ("0.1.2.3", "ssrf: unspecified address"),
        ("192.0.2.10", "ssrf: special-purpose address"),
        ("198.18.0.1", "ssrf: special-purpose address"),
        ("203.0.113.7", "ssrf: special-purpose address"),
        ("::", "ssrf: unspecified address"),
        ("::1", "ssrf: loopback address"),
        ("fd12:3456::1", "ssrf: private address"),
        ("fe80::1", "ssrf: link-local address"),
        ("fe80::1%eth0", "ssrf: link-local address"),
        ("fec0::1", "ssrf: site-local address"),
        ("ff02::1", "ssrf: multicast address"),
        ("2001:db8::1", "ssrf: special-purpose address"),
        ("::ffff:127.0.0.1", "ssrf: loopback address (ipv4-mapped)"),
        ("::ffff:10.0.0.1", "ssrf: private address (ipv4-mapped)"),
        ("::ffff:169.254.169.254", "ssrf: link-local address (ipv4-mapped)"),
        ("::127.0.0.1", "ssrf: loopback address (ipv4-compatible)"),
        ("64:ff9b::a00:1", "ssrf: private address (nat64)"),
        ("64:ff9b:1::1", "ssrf: special-purpose address"),
        ("2002:7f00:1::1", "ssrf: loopback address (6to4)"),
        ("2002:a9fe:a9fe::1", "ssrf: link-local address (6to4)"),
        ("not-an-ip", "ssrf: invalid address"),
    ],
)
def test_non_public_addresses_are_refused(address: str, reason: str) -> None:
    assert address_problem(address, ()) == reason


@pytest.mark.parametrize(
    "address",
    [
        "93.184.216.34",
        "8.8.8.8",
        "1.1.1.1",
        "100.63.255.255",  # just below CGNAT
        "100.128.0.0",  # just above CGNAT
        "172.32.0.1",  # just above 172.16/12
        "2606:2800:220:1:248:1893:25c8:1946",
        "::ffff:8.8.8.8",
        "64:ff9b::808:808",
        "2002:808:808::1",
    ],
)
def test_public_addresses_pass(address: str) -> None:
    assert address_problem(address, ()) is None


def test_teredo_checks_the_embedded_client_address() -> None:
    # Teredo client address is the bitwise inverse of the last 32 bits.
    private_client = ~int(ip_address("10.0.0.1")) & 0xFFFFFFFF
    teredo = ip_address((0x20010000 << 96) | private_client)
    assert address_problem(teredo, ()) == "ssrf: private address (teredo)"


def test_allowlist_admits_only_listed_networks() -> None:
    allow = [ip_network("127.0.0.0/8"), ip_network("10.20.0.0/16")]
    assert address_problem("127.0.0.1", allow) is None
    assert address_problem("10.20.3.4", allow) is None
    assert address_problem("::ffff:127.0.0.1", allow) is None  # embedded v4 is allowlisted
    assert address_problem("10.21.0.1", allow) == "ssrf: private address"
    assert address_problem("::1", allow) == "ssrf: loopback address"
    assert address_problem(ip_address("::1"), [ip_network("::1/128")]) is None


def test_check_addresses_refuses_if_any_is_refused() -> None:
    check_addresses(["93.184.216.34", "2606:2800:220:1::1"])
    with pytest.raises(DestinationRefused) as info:
        check_addresses(["93.184.216.34", "10.0.0.1"])
    assert info.value.reason == "ssrf: private address"
    with pytest.raises(DestinationRefused, match="no addresses"):
        check_addresses([])


def test_destination_refused_is_not_an_oserror() -> None:
    # aiohttp would wrap an OSError from the resolver into a retryable DNS error.
    assert not issubclass(DestinationRefused, OSError)


def test_parse_networks() -> None:
    assert parse_networks("") == []
    assert parse_networks(" , ") == []
    assert parse_networks("127.0.0.0/8, ::1, 10.0.0.0/8") == [
        ip_network("127.0.0.0/8"),
        ip_network("::1/128"),
        ip_network("10.0.0.0/8"),
    ]
    with pytest.raises(ValueError, match=r"invalid network '10\.0\.0\.1/8' in allowlist"):
        parse_networks("10.0.0.1/8")
    with pytest.raises(ValueError, match=r"invalid network 'example\.com'"):
        parse_networks("127.0.0.0/8,example.com")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("https://hooks.example.com/a?b=c", None),
        ("http://example.com:8080/", None),
        ("HTTPS://example.com/", None),
        ("ftp://example.com/", "url: scheme must be http or https"),
        ("javascript:alert(1)", "url: scheme must be http or https"),
        ("//example.com/", "url: scheme must be http or https"),
        ("http:///path", "url: missing host"),
        ("http://user:secret@example.com/", "url: userinfo not allowed"),
        ("http://user@example.com/", "url: userinfo not allowed"),
        ("http://example.com:99999/", "url: malformed"),
        ("http://example.com:0/", "url: invalid port"),
        ("http://exa mple.com/", "url: whitespace not allowed"),
        ("http://[::1/", "url: malformed"),
    ],
)
def test_url_problem_shape(url: str, problem: str | None) -> None:
    assert url_problem(url) == problem


def test_url_problem_with_allowlist_checks_literal_hosts_only() -> None:
    assert url_problem("http://127.0.0.1:8080/x") is None  # shape only
    assert url_problem("http://127.0.0.1:8080/x", allow=()) == "ssrf: loopback address"
    assert url_problem("http://[::1]/x", allow=()) == "ssrf: loopback address"
    assert url_problem("http://127.0.0.1/x", allow=[ip_network("127.0.0.0/8")]) is None
    assert url_problem("http://localhost/x", allow=()) is None  # names are checked when resolved


def test_reasons_never_contain_the_url() -> None:
    url = "http://user:tok_s3cr3t@10.0.0.1/tok_s3cr3t?tok_s3cr3t=1"
    problem = url_problem(url, allow=())
    assert problem is not None
    assert "tok_s3cr3t" not in problem


@pytest.mark.parametrize(
    "host", ["2130706433", "0x7f000001", "0x7f.1", "127.1", "017.0.0.1", "127.0.0.1."]
)
def test_non_canonical_numeric_hosts_are_refused(host: str) -> None:
    assert host_problem(host, ()) == "url: non-canonical numeric host"


def test_host_problem_allows_ordinary_names() -> None:
    assert host_problem("hooks.example.com", ()) is None
    assert host_problem("1e100.net", ()) is None
    assert host_problem("", ()) == "url: missing host"


async def test_resolve_and_check_refuses_localhost() -> None:
    with pytest.raises(DestinationRefused) as info:
        await resolve_and_check("localhost", 80, ())
    assert info.value.reason == "ssrf: loopback address"


async def test_resolve_and_check_literal_and_allowlist() -> None:
    assert await resolve_and_check("127.0.0.1", 80, [ip_network("127.0.0.0/8")]) == ["127.0.0.1"]
    with pytest.raises(DestinationRefused, match="private address"):
        await resolve_and_check("10.0.0.1", 80, ())
    with pytest.raises(DestinationRefused, match="non-canonical"):
        await resolve_and_check("2130706433", 80, ())
