"""The transactional outbox: record a delivery intent in the application's own transaction.

An application that changes its own state and must tell someone about it (a hold
expired, an invoice was issued) calls :func:`add_intent` on the connection of the
transaction that makes the change, before that transaction commits::

    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(..., hold_id)          # the state change
        await outbox.add_intent(
            conn,
            key=f"hold:{hold_id}:expired:email",
            channel="email",
            destination=customer_email,
            payload={"subject": "Your hold expired", "text": "..."},
        )

The intent is a ``deliveries`` row with ``source = 'outbox'`` in state ``pending``,
carrying its own destination and payload. It commits or rolls back together with the
state change, so there is never an email about an expiry that did not happen, nor an
expiry whose email is lost.

**The key is the business identity of the event**, never a random id or the time of
the call: ``"hold:<id>:expired:email"`` — what happened, to what, on which channel.
It is stored as ``ledger.outbox_key(key)`` (``"outbox:" + key``), is unique across the
ledger and is sent to the receiver as its idempotency key. So an application
transaction that is retried, or a job that runs twice, adds the intent once: a key
that already exists inserts nothing, and the first intent's destination and payload
stand. A transaction adding a key that another open transaction just added waits for
that one to commit or roll back. Keys are 1 to ``MAX_KEY_CHARS`` visible ASCII
characters.

From there the intent is an ordinary delivery: nothing is published from
:func:`add_intent`; the next ``relay publish`` run's pending sweep publishes it, a
consumer claims it and sends it with its idempotency key, and retries, dead letters,
replay and rescue apply as to any other row. The latency from commit to first attempt
is therefore up to one publish period (the CronJob schedule), plus the consumer's queue
time. ``provider`` selects the rate budget (default: the channel name, as for
reminders); ``urgent`` sends it through the urgent lane.

Differences from scheduled deliveries, on purpose:

* The destination and payload are stored with the intent and sent as committed; a
  reminder's are read at send time. An intent is never cancelled, never stale and
  never skipped by the consumer's pre-send checks.
* There is no ``reminder_id``: the intent's identity is its key.

:func:`add_intent` checks ``channel`` and the destination's shape: a webhook
destination must be an http(s) URL without credentials
(``service.netpolicy.url_problem``); email and SMS destinations must be non-empty. The
payload must be a JSON object; the channel adapter checks its keys at send time
(email: ``subject`` and ``text``; SMS: ``body``).

The connection needs the json/jsonb codecs: a connection from
``service.db.create_pool`` has them; for your own connections see
:func:`prepare_connection`.

This module owns the intent's validation and the one insert. Its SQL is the named
block ``insert_outbox_intent`` in ``sql/queries.sql``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, get_args

import asyncpg

from service import errors, ledger, netpolicy
from service.db import q

OutboxChannel = Literal["webhook", "email", "sms"]

CHANNELS: tuple[str, ...] = get_args(OutboxChannel)
# Channel adapters accept idempotency keys of 1-256 visible ASCII characters; the
# stored key is the caller's key with the outbox namespace in front of it.
MAX_KEY_CHARS = 256 - len(ledger.outbox_key(""))
MAX_DESTINATION_CHARS = 2048  # as for reminders
MAX_PROVIDER_CHARS = 100  # as for reminders
_KEY = re.compile(r"[\x21-\x7e]+")


class OutboxError(errors.RelayError):
    """An intent was not added. The message never contains the destination or payload."""


class InvalidIntentError(OutboxError, ValueError):
    """The intent's arguments are invalid; nothing was written."""


class NoTransactionError(OutboxError, RuntimeError):
    """``add_intent`` was called on a connection with no open transaction."""


async def prepare_connection(conn: ledger.Connection) -> None:
    """Give a connection the json/jsonb codecs :func:`add_intent` needs.

    Connections of a pool made by ``service.db.create_pool`` already have them. For a
    pool of your own, pass this as the pool's ``init``
    (``asyncpg.create_pool(dsn, init=outbox.prepare_connection)``), or await it once on
    a connection from ``asyncpg.connect``. Note that with these codecs, json and jsonb
    values are passed and returned as Python objects on that connection, not strings.
    """
    for kind in ("json", "jsonb"):
        await conn.set_type_codec(kind, encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


def _check(
    key: str,
    channel: str,
    destination: str,
    payload: dict[str, Any],
    provider: str | None,
) -> None:
    """Raise InvalidIntentError naming the first problem (never quoting the value)."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise InvalidIntentError("key must be non-empty visible ASCII without spaces")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidIntentError(f"key must be at most {MAX_KEY_CHARS} characters")
    if channel not in CHANNELS:
        raise InvalidIntentError(f"channel must be one of {', '.join(CHANNELS)}")
    if not isinstance(destination, str) or not destination.strip():
        raise InvalidIntentError("destination must be a non-empty string")
    if destination != destination.strip() or len(destination) > MAX_DESTINATION_CHARS:
        raise InvalidIntentError(
            f"destination must have no surrounding spaces and at most "
            f"{MAX_DESTINATION_CHARS} characters"
        )
    if channel == "webhook":
        # Shape only: the addresses a host resolves to are checked when it is sent to,
        # against the consumer's RELAY_ALLOW_NETWORKS (see service.netpolicy).
        problem = netpolicy.url_problem(destination)
        if problem is not None:
            raise InvalidIntentError(f"destination: {problem}")
    if not isinstance(payload, dict):
        raise InvalidIntentError("payload must be a dict (a JSON object)")
    try:
        json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError):
        raise InvalidIntentError("payload must be JSON-serializable") from None
    if provider is not None and not 1 <= len(provider) <= MAX_PROVIDER_CHARS:
        raise InvalidIntentError(f"provider must have 1-{MAX_PROVIDER_CHARS} characters")


async def add_intent(
    conn: ledger.Connection,
    *,
    key: str,
    channel: OutboxChannel,
    destination: str,
    payload: dict[str, Any],
    provider: str | None = None,
    urgent: bool = False,
) -> int | None:
    """Add a pending delivery intent inside the caller's open transaction.

    ``key`` is the business identity of the event (``"hold:<id>:expired:email"``),
    never a random id: a key that already exists inserts nothing. The module docstring
    shows the call and says what is checked here and what at send time.

    Returns the new delivery id, or None when the key already exists.

    Raises:
        NoTransactionError: ``conn`` has no open transaction (nothing is written: an
            intent outside the state change's transaction is exactly what the outbox
            exists to prevent).
        InvalidIntentError: an argument is invalid, or the connection lacks the
            jsonb codec; nothing is written.
        asyncpg.PostgresError: from the insert; the caller's transaction is then
            aborted, as for any failed statement in it.
    """
    if not conn.is_in_transaction():
        raise NoTransactionError(
            "outbox.add_intent must run inside the caller's open transaction "
            "(async with conn.transaction(): ...)"
        )
    _check(key, channel, destination, payload, provider)
    encoded = True
    try:
        delivery_id = await conn.fetchval(
            q("insert_outbox_intent"),
            ledger.outbox_key(key),
            channel,
            provider or channel,
            destination,
            payload,
            None,  # occurrence_at: the transaction's time (now())
            urgent,
        )
    except asyncpg.DataError:
        # Client-side encoding failed, so nothing reached the server and the caller's
        # transaction is intact: without the jsonb codec asyncpg wants a str.
        encoded = False
    if not encoded:
        # Raised outside the handler so the driver's error, which quotes the payload,
        # is not chained to this one and cannot reach a log line.
        raise InvalidIntentError(
            "payload could not be encoded as jsonb: the connection needs the json/jsonb "
            "codecs (use service.db.create_pool, or await outbox.prepare_connection(conn))"
        )
    return None if delivery_id is None else int(delivery_id)
