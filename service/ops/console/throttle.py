"""Failed logins per client address, and the wait they earn.

Five failures from one address within a minute block that address: every attempt gets
429 with ``Retry-After`` and is not checked at all, for 60 s the first time, then twice as
long each time it happens again (up to an hour). A successful login, or a day without a
failure, forgets the address. The count is kept in this process (the console runs as one
replica); at most ``MAX_ADDRESSES`` are remembered, the least recently failed dropped.

Behind a proxy (an ingress) every request comes from the proxy: ``client_address`` takes
the address the trusted proxies put in ``X-Forwarded-For`` (``RELAY_CONSOLE_PROXY_HOPS``).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

MAX_FAILURES = 5
WINDOW_SECONDS = 60.0
FIRST_BLOCK_SECONDS = 60.0
MAX_BLOCK_SECONDS = 3600.0
FORGET_SECONDS = 86400.0
MAX_ADDRESSES = 10_000


@dataclass
class _Address:
    failures: deque[float] = field(default_factory=deque)
    blocked_until: float = 0.0
    blocks: int = 0
    last_failure: float = 0.0


class LoginThrottle:
    """Counts failures per address and says how long an address must wait."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._now = monotonic
        self._addresses: OrderedDict[str, _Address] = OrderedDict()

    def _get(self, address: str) -> _Address | None:
        state = self._addresses.get(address)
        if state is not None and self._now() - state.last_failure > FORGET_SECONDS:
            del self._addresses[address]
            return None
        return state

    def wait_seconds(self, address: str) -> float:
        """How long ``address`` must still wait before a login is checked (0: not blocked)."""
        state = self._get(address)
        if state is None:
            return 0.0
        return max(0.0, state.blocked_until - self._now())

    def failed(self, address: str) -> float:
        """Count a failure; the block it starts (seconds), or 0."""
        now = self._now()
        state = self._get(address) or _Address()
        self._addresses[address] = state
        self._addresses.move_to_end(address)
        while len(self._addresses) > MAX_ADDRESSES:
            self._addresses.popitem(last=False)
        state.last_failure = now
        state.failures.append(now)
        while state.failures and now - state.failures[0] > WINDOW_SECONDS:
            state.failures.popleft()
        if len(state.failures) < MAX_FAILURES:
            return 0.0
        block = min(FIRST_BLOCK_SECONDS * float(2**state.blocks), MAX_BLOCK_SECONDS)
        state.blocks += 1
        state.blocked_until = now + block
        state.failures.clear()  # the next block takes five new failures
        return block

    def succeeded(self, address: str) -> None:
        """A good login: forget the address's failures and blocks."""
        self._addresses.pop(address, None)


def client_address(request: web.Request, proxy_hops: int) -> str:
    """The client's address: the peer's, or with ``proxy_hops`` trusted proxies in front,
    the entry they appended to ``X-Forwarded-For`` (``proxy_hops`` from the right)."""
    peer = request.remote or "unknown"
    if proxy_hops <= 0:
        return peer
    hops = [h.strip() for h in ",".join(request.headers.getall("X-Forwarded-For", [])).split(",")]
    hops = [h for h in hops if h]
    return hops[-proxy_hops] if len(hops) >= proxy_hops else peer
