"""``relay demo``: the whole pipeline on this machine, with real processes.

Each run makes its own database (``relay_demo_<hex>``) on the configured PostgreSQL server
and uses its own broker namespace (``relay-demo-<hex>``), so two demos on the same servers
never meet; both are removed when the run ends, however it ends (``--keep`` leaves them).
It starts the demo partner endpoint (which verifies signatures and counts logical events
per idempotency key) and local e-mail and SMS providers (``demo_providers``: they post
signed receipts, some late, some bounces), loads sample reminders due now (a few webhooks
pointing at a path that fails once with 503, a few at one that rejects with 400; e-mails
and SMS), then runs ``relay migrate``, ``relay reminders load``, ``relay receipts``, ``relay
publish`` and ``relay consume`` as subprocesses — exactly what an operator would run — until
the ledger has nothing left to do and no receipt is awaited, and prints the run report, the
partner's and the providers' counts and the suppressions.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from service import amqp, db, errors, receipts
from service.ops import demo_providers
from service.ops import partner as partner_mod
from service.settings import Settings


@dataclass(frozen=True)
class _Run:
    """What one demo run owns on the shared servers and on disk."""

    token: str  # random hex: two runs at once never pick the same
    database_url: str
    state_dir: Path

    @property
    def database(self) -> str:
        return f"relay_demo_{self.token}"

    @property
    def namespace(self) -> str:
        return f"relay-demo-{self.token}"


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def _database_sql(block: str, name: str) -> str:
    """A demo_* block with ``{database}`` for the database ``name`` (an identifier cannot
    be a parameter: the name is the demo's own, checked, and quoted)."""
    if not re.fullmatch(r"relay_demo_[0-9a-f]+", name):
        raise ValueError(f"not a demo database name: {name!r}")
    return block.replace("{database}", f'"{name}"')


# CREATE and DROP DATABASE wait for a checkpoint and, with FORCE, for the database's
# other sessions to end: on a machine busy writing that can outlast the per-statement
# deadline meant for the hot path (seen: a DROP cancelled at 10 s under two test suites).
_ADMIN_DEADLINE_SECONDS = 120.0


async def _admin(settings: Settings, sql: str) -> None:
    # Through db.create_pool: a server that cannot be used is one line naming it (exit 3).
    admin = await db.create_pool(
        settings.model_copy(update={"database_command_timeout_seconds": _ADMIN_DEADLINE_SECONDS}),
        size=1,
        check_schema=False,
    )
    try:
        await admin.execute(sql)
    finally:
        await admin.close()


async def _delete_namespace(settings: Settings, namespace: str) -> None:
    connection = await amqp.connect(settings, name="relay-demo")
    async with connection:
        channel = await connection.channel()
        topology = amqp.Topology.from_settings(
            settings.model_copy(update={"amqp_namespace": namespace})
        )
        await amqp.delete_topology(channel, topology)


# DROP DATABASE ... WITH (FORCE) waits at most 5 s for the other sessions of the database
# to end (the run's consumers' and receivers' connections, closing as they exit); on a
# loaded machine that can take longer, so a drop refused for it is tried again.
_DROP_ATTEMPTS, _DROP_PAUSE_SECONDS = 6, 2.0


async def _drop_database(settings: Settings, run: _Run) -> None:
    drop = _database_sql(db.q("demo_drop_database"), run.database)
    for attempt in range(1, _DROP_ATTEMPTS + 1):
        try:
            await _admin(settings, drop)
            return
        except asyncpg.ObjectInUseError:
            if attempt == _DROP_ATTEMPTS:
                raise
            await asyncio.sleep(_DROP_PAUSE_SECONDS)


async def _remove(settings: Settings, run: _Run) -> None:
    """Drop the run's database and delete its broker namespace; a part that cannot be
    removed is one line naming it (the demo's outcome stands)."""
    try:
        await _drop_database(settings, run)
    except Exception as exc:  # the server went away meanwhile: say what is left
        print(f"-- could not drop database {run.database} ({type(exc).__name__})")
    try:
        await _delete_namespace(settings, run.namespace)
    except Exception as exc:
        print(f"-- could not delete broker namespace {run.namespace} ({type(exc).__name__})")


@contextlib.asynccontextmanager
async def _own_servers(settings: Settings, keep: bool) -> AsyncIterator[_Run]:
    """A database and a broker namespace of this run's own, removed when it ends (also
    on failure or Ctrl-C) unless ``keep``."""
    token = secrets.token_hex(4)
    run = _Run(
        token=token,
        database_url=_with_database(
            settings.database_url.get_secret_value(), f"relay_demo_{token}"
        ),
        state_dir=Path(settings.state_dir) / "demo" / token,
    )
    await _admin(settings, _database_sql(db.q("demo_create_database"), run.database))
    run.state_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"-- this run: database {run.database}, broker namespace {run.namespace}, files in"
        f" {run.state_dir} ({'kept' if keep else 'removed'} at the end)",
        flush=True,
    )
    try:
        yield run
    finally:
        if not keep:
            await _remove(settings, run)


def _reminder_lines(count: int, port: int) -> list[str]:
    now = datetime.now(UTC).replace(microsecond=0).isoformat()
    lines = []
    for i in range(count):
        path = "partner-a" if i % 2 else "partner-b"
        if i % 50 == 7:
            path = "flaky"  # answers 503 once per key, then accepts: shows retries
        if i % 200 == 13:
            path = "rejecting"  # answers 400: shows a dead letter in the report
        lines.append(
            json.dumps(
                {
                    "id": f"demo-{i:05d}",
                    "channel": "webhook",
                    "destination": f"http://127.0.0.1:{port}/hooks/{path}",
                    "payload": {"text": f"Reminder {i}", "n": i},
                    "due_at": now,
                }
            )
        )
    return lines


@dataclass(frozen=True)
class _Relay:
    """Runs ``relay`` subcommands as subprocesses, exactly as an operator would."""

    env: dict[str, str]  # points them at the demo's database, broker namespace and partner

    async def run(self, *argv: str, stderr: IO[Any] | None = None) -> int:
        """Run one subcommand to completion; its exit code. Interrupted (Ctrl-C), the
        subcommand is killed: nothing outlives the demo."""
        proc = await self.start(*argv, stderr=stderr)
        try:
            return await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def start(self, *argv: str, stderr: IO[Any] | None = None) -> asyncio.subprocess.Process:
        """Start one subcommand; the caller waits for it."""
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "service.ops.cli", *argv, env=self.env, stderr=stderr
        )


def _demo_env(run: _Run, secret: str) -> dict[str, str]:
    return {
        **os.environ,
        "RELAY_DATABASE_URL": run.database_url,
        "RELAY_AMQP_NAMESPACE": run.namespace,
        "RELAY_ALLOW_NETWORKS": "127.0.0.0/8",
        "RELAY_WEBHOOK_SIGNING_SECRETS": secret,
        "RELAY_RETRY_BASE_SECONDS": "1",
        "RELAY_HEALTH_PORT": "0",
    }


def _demo_partner(secret: str) -> partner_mod.Partner:
    """The partner endpoint, with one path that fails once per key and one that rejects."""
    partner = partner_mod.Partner(verify_secret=secret)
    partner.rules["flaky"] = partner_mod.PathRule(status=503, first_n_per_key=1)
    partner.rules["rejecting"] = partner_mod.PathRule(status=400)
    return partner


async def _migrate_and_load(relay: _Relay, state_dir: Path, count: int, port: int) -> bool:
    """``relay migrate``, then ``relay reminders load`` of ``count`` webhook reminders and
    a twentieth as many (at least 8) e-mail and SMS ones, due now."""
    if await relay.run("migrate") != 0:
        return False
    reminders_file = state_dir / "reminders.jsonl"
    messages = max(8, count // 20)
    lines = _reminder_lines(count, port) + demo_providers.reminder_lines(messages)
    reminders_file.write_text("\n".join(lines) + "\n")
    print(
        f"-- loading {count} webhook, {messages} e-mail and {messages} SMS reminders due now",
        flush=True,
    )
    return await relay.run("reminders", "load", str(reminders_file)) == 0


async def _publish(relay: _Relay, state_dir: Path) -> None:
    """One ``relay publish`` run; a failed run is reported, and the demo goes on."""
    print("-- publish run (discovery)", flush=True)
    with open(state_dir / "publish.log", "w") as publish_log:
        code = await relay.run("publish", stderr=publish_log)
    if code != 0:
        print(f"publish run exited {code}", flush=True)


async def _start_consumers(
    relay: _Relay, count: int, log_path: Path, consumers: list[asyncio.subprocess.Process]
) -> None:
    """Start ``count`` ``relay consume`` processes, each appended to ``consumers`` as it
    starts (so the caller's cleanup reaches every one started)."""
    print(f"-- starting {count} consumers", flush=True)
    with open(log_path, "w") as consumer_log:
        for _ in range(count):
            consumers.append(await relay.start("consume", stderr=consumer_log))


async def _wait_until_drained(database_url: str, timeout_seconds: float) -> None:
    """Return when the ledger has no open row left and no e-mail or SMS waits for its
    receipt (those the providers deliver late too), or after ``timeout_seconds``."""
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    try:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            left = await _open_rows(pool)
            waiting = await receipts.overdue_total(pool, 0.0)
            if left == 0 and waiting == 0:
                break
            await asyncio.sleep(0.5)
    finally:
        await pool.close()


async def _open_rows(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval(db.q("open_count")))


async def _stop(consumers: list[asyncio.subprocess.Process]) -> None:
    """SIGTERM every consumer still running (each drains and exits), then wait for all of
    them; one that had exited on its own is named (its log says why)."""
    for index, proc in enumerate(consumers, 1):
        if proc.returncode is not None:
            print(f"-- consumer {index} had exited on its own (exit {proc.returncode})")
            continue
        with contextlib.suppress(ProcessLookupError):  # exiting just now
            proc.send_signal(signal.SIGTERM)
    for proc in consumers:
        await proc.wait()


async def _kill_left(consumers: list[asyncio.subprocess.Process]) -> None:
    for proc in consumers:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _report(
    relay: _Relay, partner: partner_mod.Partner, providers: demo_providers.Providers
) -> None:
    """The run report, who did not get it, what the partner endpoint and the e-mail and
    SMS providers saw, and the addresses their receipts suppressed."""
    print("-- run report (relay status)", flush=True)
    await relay.run("status")
    print("-- who did not get it (relay status --missing)", flush=True)
    await relay.run("status", "--missing")
    stats = partner.stats()
    print("-- partner endpoint saw", flush=True)
    print(
        f"   requests={stats['requests']} logical events={stats['logical_events']} "
        f"duplicates={stats['duplicates']} bad signatures={stats['bad_signatures']}"
    )
    print(f"   by path: {json.dumps(stats['by_path'], sort_keys=True)}", flush=True)
    print("-- e-mail and SMS providers saw (their receipts went to relay receipts)", flush=True)
    print("\n".join(providers.summary()), flush=True)
    print("-- suppressed by receipts (relay suppressions list)", flush=True)
    await relay.run("suppressions", "list")


async def main(args: argparse.Namespace, settings: Settings) -> int:
    """``relay demo``: set up, load, publish, consume until drained, report, clean up."""
    print("== reminder-relay demo ==", flush=True)
    async with _own_servers(settings, keep=args.keep) as run:
        return await _run(args, run)


async def _run(args: argparse.Namespace, run: _Run) -> int:
    """Load, publish, consume until drained, then the report (before the run's database
    is dropped)."""
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    partner = _demo_partner(secret)
    runner, port = await partner_mod.start(partner)
    providers = await demo_providers.start()
    relay = _Relay({**_demo_env(run, secret), **providers.env()})
    consumers: list[asyncio.subprocess.Process] = []
    log_path = run.state_dir / "consumers.log"
    try:
        if not await _migrate_and_load(relay, run.state_dir, args.reminders, port):
            return errors.ExitCode.INCOMPLETE
        with open(run.state_dir / "receipts.log", "w") as receipts_log:
            consumers.append(
                await relay.start("receipts", stderr=receipts_log)
            )  # stopped with them
        started = time.monotonic()
        await _publish(relay, run.state_dir)
        await _start_consumers(relay, args.consumers, log_path, consumers)
        await _wait_until_drained(run.database_url, timeout_seconds=120)
        elapsed = time.monotonic() - started
        await _stop(consumers)
        print(f"-- drained in {elapsed:.1f} s; consumer logs: {log_path}", flush=True)
        await _report(relay, partner, providers)
        return errors.ExitCode.OK
    finally:
        await _kill_left(consumers)
        await runner.cleanup()
        await providers.close()
