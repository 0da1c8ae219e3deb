"""Server-side console sessions, kept in PostgreSQL (``console_sessions``).

The cookie holds only a random id (256 bits); the table holds its SHA-256, the operator,
the operators-file line it was opened with (``credential``), the session's CSRF token and
its times. A session is valid while its row is not revoked, younger than the absolute
limit (``RELAY_CONSOLE_SESSION_MAX_HOURS``, 12 h) and used within the idle limit
(``RELAY_CONSOLE_SESSION_IDLE_MINUTES``, 30 min): one conditional UPDATE checks all three
and records the use. Logging out revokes the row, so a copied cookie stops working at
once; so does removing the operator from the operators file. Over HTTPS
(``RELAY_CONSOLE_HTTPS``) the cookie is ``__Host-relay_console``, ``Secure``.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import timedelta

import asyncpg

from service import db
from service.clock import Clock

COOKIE = "relay_console"
SECURE_COOKIE = "__Host-relay_console"  # Secure, Path=/, no Domain: this host only
KEEP_EXPIRED = timedelta(days=30)  # ended sessions stay this long for the record


@dataclass(frozen=True)
class Policy:
    """How long sessions live and how their cookie is set."""

    idle_seconds: float = 30 * 60
    absolute_seconds: float = 12 * 3600
    https: bool = False

    @property
    def cookie(self) -> str:
        return SECURE_COOKIE if self.https else COOKIE


@dataclass(frozen=True)
class Session:
    """A live session: who, with which operators-file line, and its CSRF token."""

    row_id: int
    operator: str
    credential: str
    csrf: str


def _id_hash(cookie: str) -> bytes:
    return hashlib.sha256(cookie.encode()).digest()


class Sessions:
    """Opens, finds (and touches) and revokes sessions."""

    def __init__(self, pool: asyncpg.Pool, clock: Clock, policy: Policy) -> None:
        self.pool = pool
        self.clock = clock
        self.policy = policy

    async def open(self, operator: str, credential: str) -> str:
        """A new session for ``operator``: the cookie's value."""
        cookie = secrets.token_urlsafe(32)
        now = self.clock.now()
        expires = now + timedelta(seconds=self.policy.absolute_seconds)
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(db.q("console_sessions_prune"), now - KEEP_EXPIRED)
            await conn.execute(
                db.q("console_session_open"),
                _id_hash(cookie),
                operator,
                credential,
                secrets.token_urlsafe(32),
                now,
                expires,
            )
        return cookie

    async def find(self, cookie: str | None) -> Session | None:
        """The live session of ``cookie`` (its use recorded), or None."""
        if not cookie or len(cookie) > 128:
            return None
        row = await self.pool.fetchrow(
            db.q("console_session_touch"),
            _id_hash(cookie),
            self.clock.now(),
            timedelta(seconds=self.policy.idle_seconds),
        )
        if row is None:
            return None
        return Session(row["id"], row["operator"], row["credential"], row["csrf"])

    async def revoke(self, cookie: str, why: str) -> bool:
        """End the session of ``cookie`` now (``why``: logout or operator_gone)."""
        revoked = await self.pool.fetchval(
            db.q("console_session_revoke"), _id_hash(cookie), self.clock.now(), why
        )
        return revoked is not None
