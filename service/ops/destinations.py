"""``relay destinations``: the registry of webhook destinations (``service.destinations``).

add, show, list, rotate-secret, disable, enable, envelope and rekey; each prints a table
or, with ``--json``, one JSON object. ``show --reveal-secret`` is the only command that
prints a secret (to stdout, never to a log).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, TypeAlias

import asyncpg

from service import db, destination_switch, destinations, errors, netpolicy, subscriptions
from service.clock import SystemClock
from service.ops import cli_events, cli_operators
from service.settings import Settings

Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
Command = Callable[..., argparse.ArgumentParser]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``24h``, ``7d`` or plain seconds -> seconds."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 15m, 24h or 7d: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def add_parser(sub: Subcommands, command: Command) -> None:
    """The ``relay destinations`` subcommands (``command`` makes one with help and examples)."""
    dst = command(
        sub,
        "destinations",
        "the webhook destinations: state, own signing secrets, options",
        "relay destinations add https://partner.example/hooks/r",
        "relay destinations show https://partner.example/hooks/r --reveal-secret",
    )
    dsub = dst.add_subparsers(dest="action", required=True, metavar="ACTION")
    example = "https://partner.example/hooks/r"
    specs: list[tuple[str, str, str]] = [
        ("add", "register a destination with a fresh signing secret", f"{example} --envelope"),
        ("show", "one destination (--reveal-secret prints its secrets)", example),
        ("list", "every destination and its state", ""),
        ("rotate-secret", "a new signing secret; the old ones sign until the grace ends",
         f"{example} --grace 24h"),
        ("disable", "hold a destination's deliveries (none is sent) and pause its reminders",
         f"{example} --reason 'partner migrating'"),
        ("enable", "send again: resume what disable paused (never a cancelled reminder); "
         "a dry run unless --apply", f"{example} --reason 'partner back' --apply"),
        ("envelope", "turn the Standard Webhooks event envelope on or off", f"{example} on"),
        ("rekey", "re-encrypt every stored secret with the first RELAY_DESTINATION_SECRETS_KEYS"
         " key", ""),
    ]  # fmt: skip
    for name, summary, args in specs:
        parser = command(dsub, name, summary, f"relay destinations {name} {args}".rstrip())
        if name not in ("list", "rekey"):
            parser.add_argument("url", help="the destination's URL (normalised before use)")
        parser.add_argument("--json", action="store_true", help="print JSON instead of text")
        if name == "add":
            parser.add_argument(
                "--envelope", action="store_true", help="send the Standard Webhooks envelope"
            )
        elif name == "show":
            parser.add_argument(
                "--reveal-secret", action="store_true", help="print its valid signing secrets"
            )
        elif name == "rotate-secret":
            parser.add_argument(
                "--grace",
                type=parse_duration,
                required=True,
                help="how long the old secrets keep signing (90s, 15m, 24h, 7d)",
            )
        elif name == "disable":
            parser.add_argument("--reason", required=True, help="why (shown by show and list)")
            cli_operators.add_operator(parser)
        elif name == "enable":
            parser.add_argument("--reason", default=None, help="why (recorded; needed to apply)")
            parser.add_argument("--apply", action="store_true", help="do it (default: dry run)")
            cli_operators.add_operator(parser)
        elif name == "envelope":
            parser.add_argument("setting", choices=["on", "off"], help="on or off")
    cli_events.add_subscribe(dsub, command)


@asynccontextmanager
async def _pool(settings: Settings) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(settings, size=2)
    try:
        yield pool
    finally:
        await pool.close()


def _vault(settings: Settings) -> destinations.Vault:
    vault = destinations.vault_from_keys(
        [k.get_secret_value() for k in settings.destination_secrets_keys]
    )
    if vault is None:
        raise errors.ConfigError(
            "RELAY_DESTINATION_SECRETS_KEYS: not set; destinations' own secrets are "
            "encrypted with it"
        )
    return vault


def allowed_networks(settings: Settings) -> netpolicy.AllowList:
    """RELAY_ALLOW_NETWORKS, parsed; a bad value is exit 2."""
    try:
        return netpolicy.parse_networks(settings.allow_networks)
    except ValueError as exc:
        raise errors.ConfigError(f"RELAY_ALLOW_NETWORKS: {exc}") from None


def _url(args: argparse.Namespace, settings: Settings) -> str:
    """The argument's URL, normalised; a URL the destination policy refuses is exit 2
    (the check the console's destination switch makes too)."""
    return destination_switch.target(args.url, allowed_networks(settings))


def _plain(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def _print(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, default=_plain, indent=2) if args.json else text)


def _missing(url: str) -> int:
    print(f"relay: no destination {url} (register it with `relay destinations add`)",
          file=sys.stderr)  # fmt: skip
    return errors.ExitCode.INCOMPLETE


def _describe(row: asyncpg.Record) -> dict[str, Any]:
    return {
        "id": row["id"],
        "url": row["url"],
        "state": row["state"],
        "disabled_reason": row["disabled_reason"],
        "disabled_at": row["disabled_at"],
        "failure_streak": row["failure_streak"],
        "streak_started_at": row["streak_started_at"],
        "envelope": row["envelope"],
        "secrets": row["active_secrets"],
        "created_at": row["created_at"],
    }


def _line(d: dict[str, Any]) -> str:
    state = d["state"] if d["state"] == "enabled" else f"disabled ({d['disabled_reason']})"
    return (
        f"{d['id']:>5}  {d['url']}  {state}  streak {d['failure_streak']}  "
        f"secrets {d['secrets'] or 'shared'}  envelope {'on' if d['envelope'] else 'off'}"
    )


async def add(args: argparse.Namespace, settings: Settings) -> int:
    url = _url(args, settings)
    registration = destinations.Registration(vault=_vault(settings))
    async with _pool(settings) as pool, pool.acquire() as conn, conn.transaction():
        added = await destinations.register(conn, [url], registration, envelope=args.envelope)
    if not added:
        print(f"relay: {url} is already registered (see `relay destinations show`)",
              file=sys.stderr)  # fmt: skip
        return errors.ExitCode.INCOMPLETE
    _print(
        args,
        {"url": url, "added": True, "envelope": args.envelope},
        f"added {url} with a fresh signing secret; give it to the partner: "
        f"relay destinations show {url} --reveal-secret",
    )
    return errors.ExitCode.OK


async def show(args: argparse.Namespace, settings: Settings) -> int:
    url = _url(args, settings)
    vault = _vault(settings) if args.reveal_secret else None
    async with _pool(settings) as pool:
        row = await pool.fetchrow(db.q("destination_get"), url)
        secrets = await pool.fetch(db.q("destination_secrets_of"), url)
        actions = await destination_switch.actions_of(pool, url)
        subscribed = await subscriptions.of(pool, url)
    if row is None:
        return _missing(url)
    data = _describe(row)
    listed = []
    for record in secrets:
        item: dict[str, Any] = {k: record[k] for k in ("id", "created_at", "expires_at", "valid")}
        if vault is not None and record["valid"]:
            try:
                item["secret"] = vault.decrypt(record["encrypted"])
            except ValueError as exc:
                raise errors.ConfigError(f"RELAY_DESTINATION_SECRETS_KEYS: {exc}") from None
        listed.append(item)
    data["secrets"] = listed
    lines = [_line({**data, "secrets": sum(1 for s in listed if s["valid"])})]
    for s in listed:
        until = f"valid until {_plain(s['expires_at'])}" if s["expires_at"] else "current"
        lines.append(
            f"  secret {s['id']}: {until if s['valid'] else 'expired'}"
            + (f"  {s['secret']}" if "secret" in s else "")
        )
    if not listed:
        lines.append("  no secret of its own: signed with RELAY_WEBHOOK_SIGNING_SECRETS")
    data["subscriptions"] = [
        {k: s[k] for k in ("pattern", "filter", "provider", "created_at")} for s in subscribed
    ]
    lines.extend(
        f"  subscribed to {s['pattern']} ({subscriptions.describe_filter(s['filter'])}, "
        f"budget {s['provider'] or 'webhook'})"
        for s in subscribed
    )
    data["actions"] = [a.__dict__ for a in actions]
    for a in actions:
        effect = ", ".join(f"{k} {v}" for k, v in a.effect.items() if v)
        lines.append(
            f"  {_plain(a.at)} {a.action} by {a.operator}: {a.reason}"
            + (f" ({effect})" if effect else "")
        )
    _print(args, data, "\n".join(lines))
    return errors.ExitCode.OK


async def list_(args: argparse.Namespace, settings: Settings) -> int:
    async with _pool(settings) as pool:
        rows = await pool.fetch(db.q("destination_get"), None)
    found = [_describe(r) for r in rows]
    _print(args, {"destinations": found}, "\n".join(map(_line, found)) or "no destinations")
    return errors.ExitCode.OK


async def rotate_secret(args: argparse.Namespace, settings: Settings) -> int:
    url = _url(args, settings)
    vault = _vault(settings)
    shared = [s.get_secret_value() for s in settings.webhook_signing_secrets]
    async with _pool(settings) as pool, pool.acquire() as conn:
        done = await destinations.rotate(conn, url, vault, args.grace, shared)
    if not done:
        return _missing(url)
    _print(
        args,
        {"url": url, "rotated": True, "grace_seconds": args.grace},
        f"rotated: a new secret signs {url}; the previous ones sign too for {args.grace:g} s. "
        f"Give the partner the new one: relay destinations show {url} --reveal-secret",
    )
    return errors.ExitCode.OK


async def disable(args: argparse.Namespace, settings: Settings) -> int:
    url = _url(args, settings)
    async with _pool(settings) as pool, pool.acquire() as conn:
        done = await destination_switch.disable(
            conn, url, operator=args.operator, reason=args.reason
        )
    data = destination_switch.disabled_dict(url, done)
    text = (
        f"disabled {url}: its deliveries are held, {done.reminders_paused} reminders paused"
        if data["changed"]
        else f"{url} was already disabled"
    )
    _print(args, data, text)
    return errors.ExitCode.OK


async def enable(args: argparse.Namespace, settings: Settings) -> int:
    url = _url(args, settings)
    async with _pool(settings) as pool, pool.acquire() as conn:
        done = await destination_switch.enable(
            conn,
            url,
            now=SystemClock().now(),
            missed=destination_switch.MissedFire.of(settings),
            apply=args.apply,
            operator=args.operator,
            reason=args.reason,
        )
    if done is None:
        return _missing(url)
    if not done.changed:
        print(f"relay: {url} is not disabled: nothing to do", file=sys.stderr)
        return errors.ExitCode.INCOMPLETE
    _print(args, done.as_dict(), render_enabling(done))
    return errors.ExitCode.OK


def render_enabling(done: destination_switch.Enabling) -> str:
    """What an enable did, or in a dry run would do, in words."""
    will = "" if done.applied else "would be "
    lines = [
        f"enabled {done.url}" if done.applied else f"enable {done.url}: dry run",
        f"  reminders: {done.reminders_resumed} {will}resumed; "
        f"{done.reminders_cancelled} cancelled by an operator stay cancelled",
        f"  held deliveries: {done.held_send} {will}sent now, {done.held_stale} {will}skipped "
        f"as stale, {done.held_cancelled} {will}skipped as cancelled",
        f"  occurrences due while disabled (the next publish run, by each reminder's "
        f"missed-fire policy): {done.occurrences_send} to send, {done.occurrences_stale} "
        f"already past stale_after (skipped as stale), {done.occurrences_skipped} skipped",
    ]
    if not done.applied:
        lines.append("  nothing changed; add --apply (with --reason) to do it")
    return "\n".join(lines)


async def envelope(args: argparse.Namespace, settings: Settings) -> int:
    url = _url(args, settings)
    on = args.setting == "on"
    async with _pool(settings) as pool:
        done = await destinations.set_envelope(pool, url, on)
    if not done:
        return _missing(url)
    _print(args, {"url": url, "envelope": on}, f"envelope {args.setting} for {url}")
    return errors.ExitCode.OK


async def rekey(args: argparse.Namespace, settings: Settings) -> int:
    vault = _vault(settings)
    async with _pool(settings) as pool, pool.acquire() as conn:
        try:
            count = await destinations.rekey(conn, vault)
        except ValueError as exc:
            raise errors.ConfigError(f"RELAY_DESTINATION_SECRETS_KEYS: {exc}") from None
    _print(args, {"reencrypted": count}, f"{count} secrets re-encrypted with the first key")
    return errors.ExitCode.OK
