"""The ``relay`` arguments of the event commands: ``event-types add|list|show`` and
``destinations subscribe|unsubscribe`` (``service.ops.cli`` adds them to its parser, their
handlers are ``service.ops.handlers``; ``service.ops.destinations`` calls
:func:`add_subscribe` for its own)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

# cli._command: (subparsers, name, summary, *examples) -> parser
Command = Callable[..., argparse.ArgumentParser]
_URL = "https://partner.example/hooks/r"


def _json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def add(sub: argparse._SubParsersAction, command: Command) -> None:  # type: ignore[type-arg]
    """``relay event-types``."""
    et = command(
        sub,
        "event-types",
        "the event-type catalogue partners subscribe to, each with an optional JSON Schema",
        "relay event-types add shipment.delayed --schema shipment-delayed.json",
        "relay event-types list",
    )
    esub = et.add_subparsers(dest="action", required=True, metavar="ACTION")
    add_ = command(
        esub,
        "add",
        "add an event type, or change its description and schema",
        "relay event-types add shipment.delayed --description 'ETA moved' "
        "--schema shipment-delayed.json",
    )
    add_.add_argument("name", help="the type: dot-separated words (shipment.delayed)")
    add_.add_argument("--description", default=None, help="what the event means (kept if omitted)")
    schema = add_.add_mutually_exclusive_group()
    schema.add_argument(
        "--schema",
        default=None,
        metavar="FILE",
        help="a JSON Schema (draft 2020-12 unless $schema says) every payload must satisfy "
        "(- reads stdin)",
    )
    schema.add_argument(
        "--no-schema", action="store_true", help="remove the type's schema (any payload)"
    )
    _json(add_)
    lst = command(esub, "list", "every event type and how many destinations take it",
                  "relay event-types list --json")  # fmt: skip
    _json(lst)
    show = command(
        esub,
        "show",
        "one event type: its schema and the subscriptions that take it",
        "relay event-types show shipment.delayed",
    )
    show.add_argument("name", help="the event type")
    _json(show)


def add_subscribe(dsub: argparse._SubParsersAction, command: Command) -> None:  # type: ignore[type-arg]
    """``relay destinations subscribe`` and ``unsubscribe``."""
    sub = command(
        dsub,
        "subscribe",
        "send a destination the events of a type, a prefix.* or * (optionally filtered)",
        f"relay destinations subscribe {_URL} shipment.delayed",
        f"relay destinations subscribe {_URL} 'shipment.*' --filter region=eu --budget acme",
    )
    sub.add_argument("url", help="the destination's URL (registered first)")
    sub.add_argument("type", help="an event type, a prefix ending in .* or * (every type)")
    sub.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="only events whose top-level payload FIELD equals VALUE; repeat a field for "
        "one of several values, name several fields for all of them",
    )
    sub.add_argument(
        "--budget",
        default=None,
        metavar="PROVIDER",
        help="the rate budget its deliveries spend (a RELAY_BUDGETS name; default webhook)",
    )
    sub.add_argument(
        "--backfill-since",
        default=None,
        metavar="TIME",
        help="also owe it the matching events recorded since TIME (ISO 8601 with offset): "
        "by default a new subscription receives only events recorded from now on",
    )
    sub.add_argument(
        "--backfill-until",
        default=None,
        metavar="TIME",
        help="with --backfill-since: up to TIME (default now)",
    )
    _json(sub)
    uns = command(
        dsub,
        "unsubscribe",
        "stop sending a destination a type (deliveries already owed stay owed)",
        f"relay destinations unsubscribe {_URL} shipment.delayed",
    )
    uns.add_argument("url", help="the destination's URL")
    uns.add_argument("type", help="the subscription's type, prefix.* or *, as subscribed")
    _json(uns)
