"""Destination references: how the console names a destination in a URL.

A reference is the first 16 hex digits of HMAC-SHA256(key, destination), keyed with a
secret of this deployment (32 random bytes in ``console_secrets``, made by the first
console that starts), so a reference seen in a URL, a proxy log or a browser history
cannot be matched against guessed phone numbers or addresses without the database.

The SQL blocks compute the same HMAC (RFC 2104) without an extension: the key padded
with ``ipad`` and ``opad`` is passed in, and PostgreSQL's ``sha256`` does the two rounds
(``sha256(outer || sha256(inner || destination))``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from service import db, ledger

_BLOCK = 64  # SHA-256's block size
KEY_NAME = "destination_ref"


@dataclass(frozen=True)
class RefKey:
    """The deployment's key of destination references."""

    secret: bytes

    def of(self, destination: str) -> str:
        """The reference of ``destination``."""
        return hmac.new(self.secret, destination.encode(), hashlib.sha256).hexdigest()[:16]

    def _padded(self, pad: int) -> bytes:
        return bytes(b ^ pad for b in self.secret.ljust(_BLOCK, b"\0"))

    @property
    def inner(self) -> bytes:
        """The key XOR ipad: the SQL's first round."""
        return self._padded(0x36)

    @property
    def outer(self) -> bytes:
        """The key XOR opad: the SQL's second round."""
        return self._padded(0x5C)


async def load(executor: ledger.Executor) -> RefKey:
    """This deployment's key, made (32 random bytes) if no console made it yet."""
    await executor.execute(db.q("console_secret_make"), KEY_NAME, secrets.token_bytes(32))
    secret = await executor.fetchval(db.q("console_secret"), KEY_NAME)
    return RefKey(bytes(secret))
