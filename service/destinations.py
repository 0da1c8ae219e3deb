"""The destinations registry: one door to a webhook destination's state, secrets and options.

A destination is a webhook URL, normalised (:func:`normalise`). It is registered by an
operator (``relay destinations add``) or on first use, when a reminder or an outbox intent
names it (refused instead with ``RELAY_DESTINATIONS_REGISTERED_ONLY=true``). Each has:

* a state: enabled, or disabled with a reason and since when (a 410 Gone, a failure
  streak, an operator); the deliveries of a disabled destination are held, never sent,
  and its reminders paused (``service.reminder_state``); enabling it is
  ``service.destination_switch``'s;
* a failure streak: consecutive failed attempts and when the streak began;
* its own signing secrets (``whsec_...``), encrypted at rest with a :class:`Vault` key:
  the current one, and during a rotation the previous ones until their grace ends. A
  destination without any is signed with ``RELAY_WEBHOOK_SIGNING_SECRETS`` (migration);
* options: the Standard Webhooks event envelope (off unless chosen).

Every statement is a named block of ``sql/queries.sql``; state changes are conditional
UPDATEs, as in ``service.ledger``. Nothing here logs, and no error quotes a secret.
"""

from __future__ import annotations

import base64
import secrets as random_secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from service import errors
from service.db import q
from service.reminder_state import InactiveReason

Connection = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy
Executor = Connection | asyncpg.Pool

DEFAULT_EVENT_TYPE = "reminder.due"
SECRET_PREFIX = "whsec_"
_SECRET_BYTES = 32
_DEFAULT_PORTS = {"http": 80, "https": 443}
_DECRYPTED_CACHE = 10_000

GONE = "410 gone"
FAILURE_STREAK = "failure streak"


def normalise(url: str) -> str:
    """The registry's form of a webhook URL: scheme and host lower-case, the default port
    dropped, an empty path written ``/``, no fragment. The path and query are kept as
    given (a receiver may tell them apart)."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = host if port is None or port == _DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    return urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))


def new_secret() -> str:
    """A fresh Standard Webhooks secret: ``whsec_`` and 32 random bytes in base64."""
    return SECRET_PREFIX + base64.b64encode(random_secrets.token_bytes(_SECRET_BYTES)).decode()


class Vault:
    """Encrypts destination secrets at rest with the keys of
    ``RELAY_DESTINATION_SECRETS_KEYS`` (Fernet keys; the first encrypts, every one
    decrypts, so a new key can be put first and the stored secrets re-encrypted with
    ``relay destinations rekey`` before the old key is removed)."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("at least one key is needed")
        self._fernet = MultiFernet([Fernet(key.encode()) for key in keys])
        self._plain: dict[str, str] = {}

    def __repr__(self) -> str:
        return "Vault(<keys hidden>)"

    def encrypt(self, secret: str) -> str:
        return self._fernet.encrypt(secret.encode()).decode()

    def decrypt(self, token: str) -> str:
        """The secret a token holds; ValueError (never quoting either) if no key opens it."""
        plain = self._plain.get(token)
        if plain is None:
            try:
                plain = self._fernet.decrypt(token.encode()).decode()
            except InvalidToken:
                raise ValueError("a destination secret cannot be decrypted with any key") from None
            if len(self._plain) >= _DECRYPTED_CACHE:
                self._plain.clear()
            self._plain[token] = plain
        return plain

    def rekey(self, token: str) -> str:
        """The token re-encrypted with the first key."""
        try:
            return self._fernet.rotate(token.encode()).decode()
        except InvalidToken:
            raise ValueError("a destination secret cannot be decrypted with any key") from None


def vault_from_keys(keys: Sequence[str]) -> Vault | None:
    """A vault for the configured keys, or None when there are none."""
    return Vault(keys) if keys else None


def vault_of(keys: Sequence[object]) -> Vault | None:
    """A vault for RELAY_DESTINATION_SECRETS_KEYS (pydantic ``SecretStr`` values)."""
    return vault_from_keys([k.get_secret_value() for k in keys])  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Registration:
    """How an unknown destination is treated when a reminder or intent names it."""

    registered_only: bool = False  # refuse it instead of registering it
    vault: Vault | None = field(default=None, repr=False)  # None: registered without a secret

    @classmethod
    def of(cls, registered_only: bool, keys: Sequence[object]) -> Registration:
        """From RELAY_DESTINATIONS_REGISTERED_ONLY and RELAY_DESTINATION_SECRETS_KEYS."""
        return cls(registered_only, vault_of(keys))


async def enter(conn: Connection, urls: Sequence[str], registration: Registration) -> set[str]:
    """The door for destinations named by reminders and intents (normalised URLs): with
    ``registered_only`` the unknown ones are returned (refused); else they are registered
    now, in the caller's transaction, and nothing is refused."""
    if registration.registered_only:
        return await unknown(conn, urls)
    await register(conn, urls, registration)
    return set()


class NotRegisteredError(errors.RelayError):
    """A destination is not registered and ``RELAY_DESTINATIONS_REGISTERED_ONLY`` is set."""


NOT_REGISTERED = (
    "destination not registered (RELAY_DESTINATIONS_REGISTERED_ONLY=true): "
    "add it first with `relay destinations add URL`"
)


async def unknown(executor: Executor, urls: Sequence[str]) -> set[str]:
    """Which of these (normalised) URLs are not registered."""
    wanted = sorted(set(urls))
    if not wanted:
        return set()
    known = {r["url"] for r in await executor.fetch(q("destinations_known"), wanted)}
    return set(wanted) - known


async def register(
    conn: Connection, urls: Sequence[str], registration: Registration, *, envelope: bool = False
) -> list[str]:
    """Register the (normalised) URLs not registered yet, each with a fresh secret when a
    vault is configured; the URLs registered now. Runs in the caller's transaction."""
    wanted = sorted(set(urls))
    if not wanted:
        return []
    rows = await conn.fetch(q("destinations_register"), wanted, envelope)
    added = [r["url"] for r in rows]
    if added and registration.vault is not None:
        vault = registration.vault
        await conn.execute(
            q("destination_add_secrets"), added, [vault.encrypt(new_secret()) for _ in added]
        )
    return added


async def rotate(
    conn: Connection, url: str, vault: Vault, grace_seconds: float, shared: Sequence[str] = ()
) -> bool:
    """Give the destination a new current secret; its secrets still valid now stay valid
    for ``grace_seconds`` more (and no longer). A destination signed so far with the
    ``shared`` secrets (RELAY_WEBHOOK_SIGNING_SECRETS: it has none of its own) keeps them
    for the grace, stored as its own: the path off the shared secret. False if there is no
    such destination."""
    async with conn.transaction():
        if await conn.fetchval(q("destination_lock"), url) is None:
            return False
        if shared and not await conn.fetchval(q("destination_has_secrets"), url):
            tokens = [vault.encrypt(secret) for secret in shared]
            await conn.execute(q("destination_add_secrets"), [url] * len(shared), tokens)
        await conn.execute(q("destination_expire_secrets"), url, grace_seconds)
        await conn.execute(q("destination_add_secrets"), [url], [vault.encrypt(new_secret())])
    return True


async def rekey(conn: Connection, vault: Vault) -> int:
    """Re-encrypt every stored secret with the vault's first key; how many."""
    async with conn.transaction():
        rows = await conn.fetch(q("destination_secrets_all"))
        ids = [r["id"] for r in rows]
        tokens = [vault.rekey(r["encrypted"]) for r in rows]
        await conn.execute(q("destination_secrets_reencrypt"), ids, tokens)
    return len(ids)


@dataclass(frozen=True)
class Disabled:
    destination_id: int | None  # None: it was already disabled
    reminders_paused: int  # its active webhook reminders, paused now


async def disable(
    executor: Executor,
    url: str,
    reason: str,
    paused_as: InactiveReason = InactiveReason.DESTINATION_DISABLED,
) -> Disabled:
    """Disable a destination (registering it if need be): its deliveries are held and its
    active reminders paused as ``paused_as`` (so that enable resumes them, and only them),
    in one statement."""
    row = await executor.fetchrow(q("destination_disable"), url, reason[:500], paused_as.value)
    assert row is not None
    value = row["id"]
    return Disabled(None if value is None else int(value), row["paused"])


async def disable_gone(executor: Executor, url: str) -> int | None:
    """A receiver said 410 Gone: disable the destination at once and pause its reminders
    (reason ``gone``). Its id if this call disabled it, None if it already was."""
    return (await disable(executor, url, GONE, InactiveReason.GONE)).destination_id


async def set_envelope(executor: Executor, url: str, envelope: bool) -> bool:
    return await executor.fetchval(q("destination_set_envelope"), url, envelope) is not None


@dataclass(frozen=True)
class Streak:
    destination_id: int
    failures: int
    disabled_now: bool  # this failure disabled the destination


async def record_failure(
    executor: Executor, url: str, *, failures: int, span_seconds: float
) -> Streak | None:
    """One more failed attempt in the destination's streak; the streak disables it once it
    holds ``failures`` attempts (0: never) spanning ``span_seconds``. None if the
    destination is not registered."""
    row = await executor.fetchrow(
        q("destination_failed"), url, failures, span_seconds, FAILURE_STREAK
    )
    if row is None:
        return None
    return Streak(row["id"], row["streak"], row["disabled"])


async def record_success(executor: Executor, url: str) -> None:
    """An accepted attempt ends the destination's failure streak."""
    await executor.execute(q("destination_succeeded"), url)
