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
that one to commit or roll back. Keys are 1 to ``MAX_KEY_CHARS`` characters of
``service.entry.ID_ALPHABET`` (ASCII letters and digits, ``.``, ``_``, ``:``, ``-``):
every receiver accepts them as an ``Idempotency-Key`` and a ``webhook-id``.

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

:func:`add_intent` checks its arguments by ``service.entry``, exactly as the reminders
file loader checks a line, so nothing that enters is refused at send time for its shape:

* a webhook destination by the destination policy (an http(s) URL without credentials,
  whose host -- a literal address, or every address the name resolves to now -- is
  public or inside ``allow_networks``; pass the consumer's ``RELAY_ALLOW_NETWORKS``,
  parsed by ``service.netpolicy.parse_networks``). A name that does not resolve within
  ``DNS_CHECK_SECONDS`` is let through: the consumer checks every address again when it
  connects. An e-mail destination by ``email-validator`` (syntax, no DNS); an SMS
  destination must be a valid E.164 number (``+14155550123``).
* the payload: a JSON object at most 32 levels deep, no NUL character in any string, the
  channel's keys (email: ``subject`` and ``text``, optional ``html``; SMS: ``body``) and
  the channel's send-time size limit (``service.limits``).

The connection needs the json/jsonb codecs: a connection from
``service.db.create_pool`` has them; for your own connections see
:func:`prepare_connection`.

**Events** (:func:`add_event`): one business event for every partner that subscribed to
its type, instead of one intent for one destination::

    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(..., shipment_id)      # the state change
        await outbox.add_event(
            conn,
            key=f"shipment:{shipment_id}:delayed",
            event_type="shipment.delayed",
            payload={"shipment": shipment_id, "eta": "2026-03-02T10:00:00Z"},
        )

The event and one delivery per subscribed destination are written in this transaction
(``service.events``). The type must be in the catalogue (``relay event-types add``) and the
payload must satisfy its JSON Schema, if it has one; else nothing is written and
:class:`InvalidIntentError` names the field.

This module owns the intent's validation and the one insert. Its SQL is the named
block ``insert_outbox_intent`` in ``sql/queries.sql``.
"""

from __future__ import annotations

import json
from typing import Any, Literal, get_args

import asyncpg

from service import destinations, entry, errors, event_schema, events, ledger, netpolicy
from service.ledger import intake

OutboxChannel = Literal["webhook", "email", "sms"]

CHANNELS: tuple[str, ...] = get_args(OutboxChannel)
# The key as sent is the caller's key with the outbox namespace in front of it.
MAX_KEY_CHARS = entry.MAX_OUTBOX_KEY_CHARS
# The transaction holds its locks while a webhook host is resolved: at most this long.
DNS_CHECK_SECONDS = 2.0
MAX_DESTINATION_CHARS = entry.MAX_DESTINATION_CHARS  # as for reminders


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
    allow: netpolicy.AllowList,
) -> None:
    """Raise InvalidIntentError naming the argument and its first problem (never quoting
    the value). The static checks: everything but resolving a webhook's host."""
    checks = (
        ("key", entry.identifier_problem(key, MAX_KEY_CHARS)),
        ("channel", None if channel in CHANNELS else f"must be one of {', '.join(CHANNELS)}"),
        ("destination", entry.destination_problem(channel, destination, allow)),
        ("provider", None if provider is None else entry.provider_problem(provider)),
    )
    for argument, problem in checks:
        if problem is not None:
            raise InvalidIntentError(f"{argument}: {problem}")
    problem = entry.payload_problem(channel, payload, destination)
    if problem is not None:
        raise InvalidIntentError(problem)


async def add_intent(
    conn: ledger.Connection,
    *,
    key: str,
    channel: OutboxChannel,
    destination: str,
    payload: dict[str, Any],
    provider: str | None = None,
    urgent: bool = False,
    allow_networks: netpolicy.AllowList = (),
    event_type: str | None = None,
    registration: destinations.Registration | None = None,
) -> int | None:
    """Add a pending delivery intent inside the caller's open transaction.

    ``key`` is the business identity of the event (``"hold:<id>:expired:email"``),
    never a random id: a key that already exists inserts nothing. The module docstring
    shows the call and says what is checked. ``allow_networks`` are the networks a
    webhook destination may resolve to although not public (the consumer's
    ``RELAY_ALLOW_NETWORKS``); by default only public addresses. A webhook destination
    is normalised and, if unknown, registered in this transaction (with a fresh secret
    when ``registration`` has a vault) or refused (``registration.registered_only``:
    pass ``destinations.Registration.of(settings.destinations_registered_only,
    settings.destination_secrets_keys)`` to follow the relay's settings).
    ``event_type`` is the type of the Standard Webhooks envelope, for destinations that
    have it on (default ``reminder.due``).

    Returns the new delivery id, or None when the key already exists.

    Raises:
        NoTransactionError: ``conn`` has no open transaction (nothing is written: an
            intent outside the state change's transaction is exactly what the outbox
            exists to prevent).
        InvalidIntentError: an argument is invalid (the message names it and why,
            never its value), or the connection lacks the jsonb codec; nothing is
            written.
        asyncpg.PostgresError: from the insert; the caller's transaction is then
            aborted, as for any failed statement in it.
    """
    if not conn.is_in_transaction():
        raise NoTransactionError(
            "outbox.add_intent must run inside the caller's open transaction "
            "(async with conn.transaction(): ...)"
        )
    _check(key, channel, destination, payload, provider, allow_networks)
    if event_type is not None and (problem := entry.event_type_problem(event_type)):
        raise InvalidIntentError(f"event_type: {problem}")
    if channel == "webhook":
        destination = await _enter_webhook(conn, destination, allow_networks, registration)
    return await _insert(conn, key, channel, destination, payload, provider, urgent, event_type)


async def _enter_webhook(
    conn: ledger.Connection,
    destination: str,
    allow_networks: netpolicy.AllowList,
    registration: destinations.Registration | None,
) -> str:
    """A webhook destination as the ledger stores it: resolved to allowed addresses,
    normalised, and registered in this transaction (or refused when only registered ones
    may be named). InvalidIntentError otherwise."""
    refused = await entry.resolved_problem(
        destination, allow_networks, timeout_seconds=DNS_CHECK_SECONDS
    )
    if refused is not None:
        raise InvalidIntentError(f"destination: {refused}")
    url = destinations.normalise(destination)
    unknown = await destinations.enter(conn, [url], registration or destinations.Registration())
    if unknown:
        raise InvalidIntentError(f"destination: {destinations.NOT_REGISTERED}")
    return url


async def add_event(
    conn: ledger.Connection,
    *,
    key: str,
    event_type: str,
    payload: dict[str, Any],
    urgent: bool = False,
) -> intake.Recorded | None:
    """Record one business event inside the caller's open transaction, with one delivery
    per destination subscribed to its type (the module docstring shows the call).

    ``key`` is the event's business identity (``"shipment:<id>:delayed"``): a key recorded
    before inserts nothing, so a retried transaction fans the event out once; each
    delivery's key is ``event:<key>:<destination id>``. ``urgent`` sends the deliveries
    through the urgent lane.

    Returns the event's id and how many deliveries it made (0: nobody subscribes), or None
    when the key was recorded before.

    Raises:
        NoTransactionError: ``conn`` has no open transaction; nothing is written.
        InvalidIntentError: the key, type or payload is refused, in one line naming the
            argument or the payload's field (never quoting a value); nothing is written.
        asyncpg.PostgresError: from the insert; the caller's transaction is then aborted.
    """
    if not conn.is_in_transaction():
        raise NoTransactionError(
            "outbox.add_event must run inside the caller's open transaction "
            "(async with conn.transaction(): ...)"
        )
    problem = entry.identifier_problem(key, events.MAX_KEY_CHARS)
    if problem is not None:
        raise InvalidIntentError(f"key: {problem}")
    if (problem := events.type_name_problem(event_type)) is not None:
        raise InvalidIntentError(f"event_type: {problem}")
    if (problem := entry.payload_problem("webhook", payload, "")) is not None:
        raise InvalidIntentError(problem)
    known, schema = await events.schema_of(conn, event_type)
    if not known:
        raise InvalidIntentError(
            f"event_type: {event_type} is not in the catalogue "
            f"(add it with `relay event-types add {event_type}`)"
        )
    if (problem := event_schema.payload_problem(schema, payload, event_type)) is not None:
        raise InvalidIntentError(problem)
    try:
        return await intake.record_event(conn, key, event_type, payload, urgent)
    except asyncpg.DataError:
        pass  # client-side encoding failed: raised below, unchained (the driver quotes it)
    raise InvalidIntentError(_NO_CODEC)


_NO_CODEC = (
    "payload could not be encoded as jsonb: the connection needs the json/jsonb "
    "codecs (use service.db.create_pool, or await outbox.prepare_connection(conn))"
)


async def _insert(
    conn: ledger.Connection,
    key: str,
    channel: OutboxChannel,
    destination: str,
    payload: dict[str, Any],
    provider: str | None,
    urgent: bool,
    event_type: str | None,
) -> int | None:
    """Insert the intent (a pending delivery due now); its id, or None if the key exists."""
    try:
        return await intake.insert_intent(
            conn, key, channel, provider or channel, destination, payload, urgent, event_type
        )
    except asyncpg.DataError:
        # Client-side encoding failed, so nothing reached the server and the caller's
        # transaction is intact: without the jsonb codec asyncpg wants a str.
        pass
    # Raised outside the handler so the driver's error, which quotes the payload, is not
    # chained to this one and cannot reach a log line.
    raise InvalidIntentError(_NO_CODEC)
