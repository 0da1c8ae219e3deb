"""Subscriptions: which events a destination receives.

A subscription names a destination (a registered webhook URL) and a pattern:

* an exact event type (``shipment.delayed``), which must be in the catalogue;
* ``prefix.*``: every type under the prefix (``shipment.*`` takes ``shipment.delayed`` and
  ``shipment.eta.changed``, not ``shipment`` itself), types added later included;
* ``*``: every type.

Optionally a **filter** on top-level payload fields: ``FIELD=VALUE`` pairs; the payload's
field must equal one of the values given for it, and every field named must match
(``region=eu region=uk priority=high``: region eu or uk, and priority high). A VALUE that
reads as JSON (``3``, ``true``, ``null``, ``"3"``) is that value, any other text a string;
``null`` also matches a payload without the field. And optionally the **rate budget**
(``provider``, as in ``RELAY_BUDGETS``) its deliveries spend; by default the shared
``webhook`` budget.

A destination receives an event once however many of its subscriptions take it. The
subscriptions in force when an event is recorded decide who is owed it
(``service.events``): a destination subscribed later receives older events only through
a backfill (``relay destinations subscribe --backfill-since``, which runs
``service.ledger.intake.backfill_events``), on purpose. Matching is SQL
(``event_pattern_matches`` and ``event_filter_matches``, migration 0017), so the fan-out
and a backfill agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from service import entry, errors, events
from service.db import q

Connection = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy
Executor = Connection | asyncpg.Pool

EVERY_TYPE = "*"
_PREFIX = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.\*")
_FIELD = re.compile(r"[^=\s]{1,100}")
MAX_FILTER_FIELDS = 20
MAX_FILTER_VALUES = 50
Scalar = str | int | float | bool | None


class SubscriptionRefused(errors.InputError):
    """A subscription refused before anything was done (exit 2); the message says why."""


def is_prefix(pattern: str) -> bool:
    return pattern == EVERY_TYPE or pattern.endswith(".*")


def pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` is neither a type name, ``prefix.*`` nor ``*``, or None."""
    if pattern == EVERY_TYPE or (len(pattern) <= 102 and _PREFIX.fullmatch(pattern)):
        return None
    if events.type_name_problem(pattern) is None:
        return None
    return (
        "a subscription takes an event type (shipment.delayed), a prefix ending in .* "
        "(shipment.*) or * (every type)"
    )


def matches(pattern: str, event_type: str) -> bool:
    """Whether ``pattern`` takes ``event_type`` (the SQL function's rule, for the tools)."""
    if pattern in (EVERY_TYPE, event_type):
        return True
    return pattern.endswith(".*") and event_type.startswith(pattern[:-1])


def _value(text: str) -> Scalar:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, dict | list):
        raise SubscriptionRefused(f"--filter: {text!r}: a value is a string, number, true, "
                                  "false or null")  # fmt: skip
    return value  # type: ignore[no-any-return]


def parse_filter(items: Sequence[str]) -> dict[str, list[Scalar]]:
    """``["region=eu", "region=uk", "priority=high"]`` -> ``{"priority": ["high"],
    "region": ["eu", "uk"]}``; a malformed item raises SubscriptionRefused."""
    fields: dict[str, list[Scalar]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not _FIELD.fullmatch(name):
            raise SubscriptionRefused(
                f"--filter: {item!r}: expected FIELD=VALUE (a top-level payload field)"
            )
        values = fields.setdefault(name, [])
        value = _value(text)
        if value not in values:
            values.append(value)
        if len(values) > MAX_FILTER_VALUES:
            raise SubscriptionRefused(f"--filter: at most {MAX_FILTER_VALUES} values a field")
    if len(fields) > MAX_FILTER_FIELDS:
        raise SubscriptionRefused(f"--filter: at most {MAX_FILTER_FIELDS} fields")
    return dict(sorted(fields.items()))


def describe_filter(filter_: dict[str, list[Any]]) -> str:
    """``region in [eu, uk], priority = high``; ``all events`` for no filter."""
    if not filter_:
        return "no filter"
    parts = []
    for name, values in filter_.items():
        shown = [json.dumps(v) for v in values]
        parts.append(
            f"{name} = {shown[0]}" if len(shown) == 1 else f"{name} in [{', '.join(shown)}]"
        )
    return ", ".join(parts)


@dataclass(frozen=True)
class Subscribed:
    subscription_id: int
    added: bool  # False: it existed; its filter and budget were replaced


async def subscribe(
    conn: Connection,
    url: str,
    pattern: str,
    filter_: dict[str, list[Scalar]],
    provider: str | None,
) -> Subscribed | None:
    """Subscribe the (registered, normalised) destination ``url``; None if it is not
    registered. An exact type must be in the catalogue."""
    problem = pattern_problem(pattern)
    if problem is not None:
        raise SubscriptionRefused(f"{pattern!r}: {problem}")
    if provider is not None and (problem := entry.provider_problem(provider)):
        raise SubscriptionRefused(f"--budget: {problem}")
    if not is_prefix(pattern) and await conn.fetchrow(q("event_type_schema"), pattern) is None:
        raise SubscriptionRefused(
            f"no event type {pattern!r} in the catalogue (add it with `relay event-types add`, "
            "or subscribe to a prefix.*)"
        )
    try:
        row = await conn.fetchrow(q("subscription_upsert"), url, pattern, filter_, provider)
    except asyncpg.ForeignKeyViolationError:
        return None
    assert row is not None
    return Subscribed(row["id"], row["added"])


async def unsubscribe(executor: Executor, url: str, pattern: str) -> bool:
    """Remove one subscription; False if there was none. Deliveries already owed stay owed."""
    return await executor.fetchval(q("subscription_delete"), url, pattern) is not None


async def of(executor: Executor, url: str | None) -> list[dict[str, Any]]:
    """A destination's subscriptions (None: everyone's)."""
    return [dict(r) for r in await executor.fetch(q("subscriptions_of"), url)]
