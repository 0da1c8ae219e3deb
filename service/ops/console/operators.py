"""The console's operators: each has a name and a token of their own.

The operators file (``RELAY_CONSOLE_OPERATORS_FILE``, a mounted Secret) holds one line per
operator, ``NAME:scrypt$n=32768,r=8,p=1$SALT$HASH`` (base64, no padding): the scrypt hash
of the token, never the token. ``relay console-operators add NAME`` makes a token (43
random characters, 256 bits) and its line; removing the line revokes that operator alone,
and their sessions end with it (a session is tied to its line's ``credential``). The file
is read again when it changes on disk, so a revocation needs no restart; a file that
stops being valid refuses everyone (fail closed) until it is fixed.

Verifying a token costs one scrypt (~50 ms, in a thread): a bearer client's verified token
is remembered for as long as the file does not change.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from service import errors, logs

log = logs.get("console")

MIN_TOKEN_CHARS = 32
TOKEN_BYTES = 32  # secrets.token_urlsafe(32): 43 characters
SCHEME = "scrypt"
COST = (2**15, 8, 1)  # n, r, p of new hashes: 32 MiB and ~50 ms per check
MIN_N = 2**14  # a line with a cheaper hash is refused at start-up
_MAX_MEM = 128 * 1024 * 1024
_NAME = re.compile(r"^[\w.@-](?:[\w.@ -]{0,62}[\w.@-])?$")
_LINE = re.compile(
    r"^(?P<name>[^:]+):scrypt\$n=(?P<n>\d+),r=(?P<r>\d+),p=(?P<p>\d+)"
    r"\$(?P<salt>[A-Za-z0-9+/]+)\$(?P<hash>[A-Za-z0-9+/]+)$"
)
HOW = "make a token and its line with: relay console-operators add NAME --file FILE"


def valid_name(name: str) -> bool:
    """A name to record: 1-64 letters, digits, ``.@-_`` and inner spaces."""
    return bool(_NAME.match(name))


def new_token() -> str:
    """A fresh operator token: 43 URL-safe random characters."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)


def _scrypt(token: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(token.encode(), salt=salt, n=n, r=r, p=p, maxmem=_MAX_MEM, dklen=32)


def hash_line(name: str, token: str, cost: tuple[int, int, int] = COST) -> str:
    """The operators-file line of ``name`` with ``token`` (a fresh salt each time)."""
    if not valid_name(name):
        raise errors.ConfigError(f"operator name {name!r}: 1-64 letters, digits, '.@-_' or spaces")
    if len(token) < MIN_TOKEN_CHARS:
        raise errors.ConfigError(f"a token needs {MIN_TOKEN_CHARS}+ random characters")
    n, r, p = cost
    salt = secrets.token_bytes(16)
    digest = _scrypt(token, salt, n, r, p)
    return f"{name}:{SCHEME}$n={n},r={r},p={p}${_b64(salt)}${_b64(digest)}"


@dataclass(frozen=True)
class Entry:
    """One operator's line: their name and their token's hash."""

    name: str
    n: int
    r: int
    p: int
    salt: bytes
    digest: bytes

    @property
    def credential(self) -> str:
        """Names this line (not the token): a session opened with it ends with it."""
        material = self.salt + self.digest + f"{self.n},{self.r},{self.p}".encode()
        return hashlib.sha256(material).hexdigest()[:32]

    def matches(self, token: str) -> bool:
        """Whether ``token`` is this operator's (one scrypt; constant-time compare)."""
        candidate = _scrypt(token, self.salt, self.n, self.r, self.p)
        return hmac.compare_digest(candidate, self.digest)


def parse(text: str, where: str) -> dict[str, Entry]:
    """The operators of a file's text; ``ConfigError`` naming the first bad line."""
    found: dict[str, Entry] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        entry = _entry(line, f"{where} line {number}")
        if entry.name in found:
            raise errors.ConfigError(f"{where} line {number}: {entry.name} is listed twice")
        found[entry.name] = entry
    if not found:
        raise errors.ConfigError(f"{where}: no operator in it; {HOW}")
    return found


def _entry(line: str, where: str) -> Entry:
    match = _LINE.match(line)
    name = line.split(":", 1)[0].strip() if ":" in line else "?"
    if match is None:
        raise errors.ConfigError(f"{where}: not a token hash (operator {name}); {HOW}")
    if not valid_name(match["name"]):
        raise errors.ConfigError(f"{where}: operator name {match['name']!r} is not plain")
    n, r, p = int(match["n"]), int(match["r"]), int(match["p"])
    if n < MIN_N or n & (n - 1) or not 1 <= r <= 32 or not 1 <= p <= 16:
        raise errors.ConfigError(f"{where}: a hash weaker than scrypt n={MIN_N}; {HOW}")
    try:
        salt, digest = _unb64(match["salt"]), _unb64(match["hash"])
    except (binascii.Error, ValueError):
        raise errors.ConfigError(f"{where}: the salt or hash is not base64; {HOW}") from None
    if len(salt) < 16 or len(digest) != 32:
        raise errors.ConfigError(f"{where}: a salt of 16+ bytes and a 32-byte hash; {HOW}")
    return Entry(match["name"], n, r, p, salt, digest)


def read(path: Path) -> dict[str, Entry]:
    """The operators in ``path``; ``ConfigError`` (exit 2) if it cannot be read or is bad."""
    where = f"RELAY_CONSOLE_OPERATORS_FILE ({path})"
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.ConfigError(f"{where}: cannot read it ({exc}); {HOW}") from None
    return parse(text, where)


class Operators:
    """The operators file as the console sees it now."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries = read(path)  # a bad file stops start-up
        self._version = self._stat()
        self._verified: dict[tuple[str, bytes], str] = {}  # (name, token digest) -> credential

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def current(self) -> dict[str, Entry]:
        """The operators now: the file is read again when it changed since last time."""
        version = self._stat()
        if version != self._version:
            self._version = version
            self._verified.clear()
            try:
                self._entries = read(self.path)
                log.info(
                    "console operators reloaded",
                    extra={"event": "console_operators_reloaded", "operators": len(self._entries)},
                )
            except errors.ConfigError as exc:
                self._entries = {}  # fail closed: a broken edit must not keep a revoked one in
                log.error(
                    "console operators file unusable: nobody can log in",
                    extra={"event": "console_operators_unusable", "why": str(exc)},
                )
        return self._entries

    def credential_of(self, name: str) -> str | None:
        """The credential of ``name``'s line now (None: not an operator any more)."""
        entry = self.current().get(name)
        return None if entry is None else entry.credential

    async def verify(self, name: str, token: str) -> Entry | None:
        """``name``'s entry if ``token`` is theirs, else None."""
        entries = self.current()
        entry = entries.get(name)
        if len(token) < MIN_TOKEN_CHARS or len(token) > 512:
            return None
        key = (name, hashlib.sha256(token.encode()).digest())
        if entry is not None and self._verified.get(key) == entry.credential:
            return entry
        # An unknown name costs the same scrypt as a known one: timing tells no names.
        probe = entry or next(iter(entries.values()), None)
        if probe is None:
            return None
        ok = await asyncio.to_thread(probe.matches, token)
        if entry is None or not ok:
            return None
        if len(self._verified) > 1000:
            self._verified.clear()
        self._verified[key] = entry.credential
        return entry
