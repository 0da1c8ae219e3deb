"""Destination safety: which network addresses the relay may send to.

This module owns the SSRF policy shared by load-time checks (validating a
destination when a reminder is created or imported) and the webhook adapter
(checking every resolved address at connect time, so DNS rebinding cannot get
around a check made earlier). It is stdlib only and has no I/O apart from
``resolve_and_check``'s lookup.

Policy: an address is refused if it is not a plain public unicast address --
loopback, private, link-local, multicast, reserved, unspecified, shared
(CGNAT 100.64/10), documentation/benchmark ranges, and IPv6 forms that embed
such an IPv4 address (IPv4-mapped, IPv4-compatible, NAT64, 6to4, Teredo) --
unless it lies inside an explicitly allowed network.

Reasons are short fixed strings such as ``"ssrf: loopback address"``; they never
contain the URL, its path or query, so they are safe to log and to store.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable, Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from urllib.parse import urlsplit

__all__ = [
    "AllowList",
    "DestinationRefused",
    "IPAddress",
    "IPNetwork",
    "address_problem",
    "check_addresses",
    "host_problem",
    "parse_networks",
    "resolve_and_check",
    "url_problem",
]

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network
AllowList = Sequence[IPNetwork]


class DestinationRefused(Exception):
    """A destination failed the policy. ``reason`` is short and safe to log.

    Deliberately not an ``OSError``: aiohttp wraps resolver ``OSError``s into
    DNS/connection errors, which adapters classify as retryable. A refusal is
    final, so it must travel through aiohttp unchanged.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _nets4(*cidrs: str) -> tuple[IPv4Network, ...]:
    return tuple(IPv4Network(c) for c in cidrs)


def _nets6(*cidrs: str) -> tuple[IPv6Network, ...]:
    return tuple(IPv6Network(c) for c in cidrs)


# Explicit tables rather than ipaddress's is_private/is_global alone: those
# properties changed between CPython patch releases, and we want stable
# reasons. A final ``not is_global`` catches anything the tables miss.
_V4_RULES: tuple[tuple[str, tuple[IPv4Network, ...]], ...] = (
    ("unspecified address", _nets4("0.0.0.0/8")),  # "this network"; 0.0.0.0 reaches localhost
    ("loopback address", _nets4("127.0.0.0/8")),
    ("private address", _nets4("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")),
    ("shared address (cgnat)", _nets4("100.64.0.0/10")),
    ("link-local address", _nets4("169.254.0.0/16")),  # includes cloud metadata 169.254.169.254
    ("multicast address", _nets4("224.0.0.0/4")),
    ("reserved address", _nets4("240.0.0.0/4")),  # includes broadcast 255.255.255.255
    (
        "special-purpose address",
        _nets4(
            "192.0.0.0/24",  # IETF protocol assignments
            "192.0.2.0/24",  # documentation
            "192.88.99.0/24",  # deprecated 6to4 relay anycast
            "198.18.0.0/15",  # benchmarking
            "198.51.100.0/24",  # documentation
            "203.0.113.0/24",  # documentation
        ),
    ),
)

_V6_RULES: tuple[tuple[str, tuple[IPv6Network, ...]], ...] = (
    ("unspecified address", _nets6("::/128")),
    ("loopback address", _nets6("::1/128")),
    ("private address", _nets6("fc00::/7")),  # unique local
    ("link-local address", _nets6("fe80::/10")),
    ("site-local address", _nets6("fec0::/10")),  # deprecated but still routable internally
    ("multicast address", _nets6("ff00::/8")),
    (
        "special-purpose address",
        _nets6(
            "100::/64",  # discard-only
            "2001:db8::/32",  # documentation
            "2001::/23",  # IETF protocol assignments (Teredo is unwrapped first)
            "3fff::/20",  # documentation (RFC 9637)
            "64:ff9b:1::/48",  # local-use NAT64: translates into private networks
        ),
    ),
)

_NAT64 = IPv6Network("64:ff9b::/96")
_V4_COMPAT = IPv6Network("::/96")


def _embedded_ipv4(ip: IPv6Address) -> tuple[str, IPv4Address] | None:
    """The IPv4 address an IPv6 address stands for, if it embeds one."""
    if ip.ipv4_mapped is not None:
        return "ipv4-mapped", ip.ipv4_mapped
    if ip in _NAT64:
        return "nat64", IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return "6to4", ip.sixtofour
    if ip.teredo is not None:
        return "teredo", ip.teredo[1]
    if ip in _V4_COMPAT and int(ip) > 1:  # deprecated IPv4-compatible ::a.b.c.d
        return "ipv4-compatible", IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _as_address(ip: str | IPAddress) -> IPAddress:
    addr = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
    if isinstance(addr, IPv6Address) and addr.scope_id is not None:
        # Drop "%eth0": scoped addresses do not compare equal to network members.
        addr = IPv6Address(int(addr))
    return addr


def _allowed(ip: IPAddress, allow: AllowList) -> bool:
    return any(ip.version == net.version and ip in net for net in allow)


def _v4_problem(ip: IPv4Address) -> str | None:
    for reason, nets in _V4_RULES:
        if any(ip in net for net in nets):
            return reason
    return None if ip.is_global else "non-global address"


def address_problem(ip: str | IPAddress, allow: AllowList = ()) -> str | None:
    """Why ``ip`` must not be contacted, or None if it may be.

    An address inside any ``allow`` network is always permitted (for example a
    partner reachable over a private link, or 127.0.0.0/8 in tests). For IPv6
    forms embedding an IPv4 address, both the IPv6 and the embedded IPv4
    address are checked against the allowlist, and the embedded one decides.
    """
    try:
        addr = _as_address(ip)
    except ValueError:
        return "ssrf: invalid address"
    if _allowed(addr, allow):
        return None
    if isinstance(addr, IPv4Address):
        problem = _v4_problem(addr)
        return None if problem is None else f"ssrf: {problem}"

    embedded = _embedded_ipv4(addr)
    if embedded is not None:
        kind, v4 = embedded
        if _allowed(v4, allow):
            return None
        problem = _v4_problem(v4)
        return None if problem is None else f"ssrf: {problem} ({kind})"

    for reason, nets in _V6_RULES:
        if any(addr in net for net in nets):
            return f"ssrf: {reason}"
    return None if addr.is_global else "ssrf: non-global address"


def check_addresses(addresses: Iterable[str | IPAddress], allow: AllowList = ()) -> None:
    """Raise DestinationRefused if ANY address is refused (or there are none).

    One bad address is enough: connection code may try the addresses in any
    order, so a name answering with a public and a private address is refused.
    """
    seen = False
    for address in addresses:
        seen = True
        problem = address_problem(address, allow)
        if problem is not None:
            raise DestinationRefused(problem)
    if not seen:
        raise DestinationRefused("dns: no addresses")


def parse_networks(text: str) -> list[IPNetwork]:
    """Parse a comma-separated list of CIDRs (bare addresses mean /32 or /128).

    Empty input means an empty allowlist. Host bits set (``10.0.0.1/8``) are an
    error rather than silently widened, since that usually hides a typo.
    """
    networks: list[IPNetwork] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=True))
        except ValueError as exc:
            raise ValueError(f"invalid network {item!r} in allowlist: {exc}") from None
    return networks


def _literal_address(host: str) -> IPAddress | None:
    try:
        return _as_address(host)
    except ValueError:
        return None


# Hosts that look numeric but are not canonical dotted-quad (2130706433, 0x7f.1,
# 127.1, 017.0.0.1) are interpreted by inet_aton as IPv4 addresses. Refuse them
# outright: nobody legitimately configures a partner that way.
_NUMERIC_HOST = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}\.?$", re.I)


def host_problem(host: str, allow: AllowList = ()) -> str | None:
    """Static check of a URL host: literal addresses are checked against the policy.

    Names are not resolved here (see ``resolve_and_check``); a name that passes
    may still be refused when it resolves.
    """
    if not host:
        return "url: missing host"
    literal = _literal_address(host)
    if literal is not None:
        return address_problem(literal, allow)
    if _NUMERIC_HOST.match(host):
        return "url: non-canonical numeric host"
    return None


def url_problem(url: str, allow: AllowList | None = None) -> str | None:
    """Static checks of a destination URL, without any network access.

    Scheme must be http or https, a host must be present, userinfo is refused
    (credentials in URLs leak into logs and proxies), and the port must be
    valid. When ``allow`` is given, a literal IP host is also checked against
    the address policy; with ``allow=None`` only the URL shape is checked.
    """
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError when out of range or not numeric
    except ValueError:
        return "url: malformed"
    if parts.scheme.lower() not in ("http", "https"):
        return "url: scheme must be http or https"
    if "@" in parts.netloc:
        return "url: userinfo not allowed"
    host = parts.hostname
    if not host:
        return "url: missing host"
    if port == 0:
        return "url: invalid port"
    if any(ch.isspace() for ch in url):
        return "url: whitespace not allowed"
    if allow is not None:
        return host_problem(host, allow)
    return None


async def resolve_and_check(host: str, port: int, allow: AllowList = ()) -> list[str]:
    """Resolve ``host`` with the event loop's getaddrinfo and check every address.

    Returns the distinct addresses (in resolver order) if all are allowed;
    raises DestinationRefused if any is refused. Lookup failures propagate as
    ``OSError`` (``socket.gaierror``): they may be transient, and the caller
    decides whether that is fatal.
    """
    literal = _literal_address(host)
    if literal is not None:
        problem = address_problem(literal, allow)
        if problem is not None:
            raise DestinationRefused(problem)
        return [str(literal)]
    if _NUMERIC_HOST.match(host):
        raise DestinationRefused("url: non-canonical numeric host")
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses: list[str] = []
    for _family, _type, _proto, _canon, sockaddr in infos:
        address = str(sockaddr[0])
        if address not in addresses:
            addresses.append(address)
    check_addresses(addresses, allow)
    return addresses
