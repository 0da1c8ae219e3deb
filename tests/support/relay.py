"""Test helpers: run relay commands as real processes, wait on predicates, build inputs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
from opentelemetry import trace
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from pydantic import SecretStr

from consumer import run as consume_run
from service import amqp, netpolicy, telemetry
from service.ops import partner as partner_mod
from service.ops import reminders
from service.settings import Settings
from tests.support import forked
from tests.support.forked import REPO

# The networks tests send to (the partner endpoint on 127.0.0.1), as RELAY_ALLOW_NETWORKS.
LOOPBACK = netpolicy.parse_networks("127.0.0.0/8")


@dataclass
class RunningPartner:
    state: partner_mod.Partner
    port: int

    def url(self, path: str = "ok") -> str:
        return f"http://127.0.0.1:{self.port}/hooks/{path}"


def env_for(settings: Settings, **extra: str) -> dict[str, str]:
    """The RELAY_* environment that reproduces ``settings`` in a subprocess."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    for name, value in settings.model_dump().items():
        if value is None:  # unset: the subprocess's default (not the string "None")
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if isinstance(value, list):
            value = ",".join(
                v.get_secret_value() if isinstance(v, SecretStr) else str(v) for v in value
            )
        env[f"RELAY_{name.upper()}"] = str(value)
    env.update({f"RELAY_{k.upper()}": v for k, v in extra.items()})
    env["PYTHONPATH"] = str(REPO)
    return env


def log_events(text: str, event: str) -> list[dict[str, Any]]:
    """The lines of a relay process's JSON log (``text``) with this ``event``."""
    found = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


async def relay(
    settings: Settings, *args: str, timeout: float = 60, stdin: str | None = None, **extra_env: str
) -> Result:
    """Run ``relay ARGS`` as a real process (tests.support.forked) and wait for it."""
    proc = await forked.spawn(
        list(args),
        env_for(settings, **extra_env),
        stdin=forked.PIPE if stdin is not None else forked.DEVNULL,
        stdout=forked.PIPE,
        stderr=forked.PIPE,
    )
    out, err = await asyncio.wait_for(
        proc.communicate(stdin.encode() if stdin is not None else None), timeout
    )
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


async def start_consumer(
    settings: Settings, log_path: Path | None = None, **extra_env: str
) -> forked.RelayProcess:
    """Start ``relay consume`` as a real process (kill it with SIGKILL or SIGTERM).

    With ``log_path``, its stderr (the JSON log) is appended there; the child holds its
    own copy of the file, so this process closes its one at once.
    """
    env = env_for(settings, **extra_env)
    if log_path is None:
        return await forked.spawn(["consume"], env)
    with open(log_path, "ab") as log:
        return await forked.spawn(["consume"], env, stderr=log)


async def stop(proc: forked.RelayProcess, timeout: float = 30) -> int:
    """SIGTERM a relay process and return its exit code (fail after ``timeout``)."""
    proc.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(proc.wait(), timeout)


async def wait_for(
    predicate: Callable[[], Awaitable[bool]],
    timeout: float,
    what: str = "condition",
    interval: float = 0.1,
) -> None:
    """Poll ``predicate`` until true; fail the test with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@dataclass
class InProcessConsumer:
    task: asyncio.Task[int]
    reader: InMemoryMetricReader

    def metric(self, name: str, **attributes: str) -> float:
        """Sum of a counter's points whose attributes include ``attributes``."""
        data = self.reader.get_metrics_data()
        total = 0.0
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != name:
                        continue
                    for point in metric.data.data_points:
                        attrs = dict(point.attributes or {})
                        if all(attrs.get(k) == v for k, v in attributes.items()):
                            total += getattr(point, "value", 0) or getattr(point, "count", 0)
        return total


@asynccontextmanager
async def consumer_in_process(
    settings: Settings, tracer: trace.Tracer | None = None
) -> AsyncIterator[InProcessConsumer]:
    """Run a consumer in this event loop, metrics readable; stopped gracefully on exit."""
    stop = asyncio.Event()
    reader = InMemoryMetricReader()
    telem = telemetry.setup("relay-test", [reader], environ={})
    task = asyncio.create_task(
        consume_run.run(settings, metrics=telem.metrics, stop=stop, tracer=tracer)
    )
    try:
        await wait_for(lambda: topology_declared(settings), 20, "consumer declared topology")
        yield InProcessConsumer(task, reader)
    finally:
        stop.set()
        # The grace (20 s) plus closing; generous, as two suites on two cores slow it down.
        await asyncio.wait_for(task, 60)
        telem.shutdown()


async def logged(path: Path, event: str) -> bool:
    """True once a JSON log line with this ``event`` was written to ``path``."""
    if not path.exists():
        return False
    for text in path.read_text().splitlines():
        try:
            if json.loads(text).get("event") == event:
                return True
        except ValueError:
            continue
    return False


async def logged_count(path: Path, event: str, **fields: Any) -> int:
    """JSON log lines in ``path`` with this ``event`` and these field values."""
    if not path.exists():
        return 0
    found = 0
    for text in path.read_text().splitlines():
        try:
            record = json.loads(text)
        except ValueError:
            continue
        if record.get("event") == event and all(record.get(k) == v for k, v in fields.items()):
            found += 1
    return found


async def topology_declared(settings: Settings) -> bool:
    """True once a consumer or publisher has declared the whole topology: its last queue,
    the longest delay tier, exists. ``amqp.declare`` runs one declaration after another,
    so every binding before it is made too. (The bulk lane's queue exists a moment before
    its binding: a message published in that moment is returned unroutable.)"""
    topology = amqp.Topology.from_settings(settings)
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        channel = await connection.channel()
        try:
            await channel.declare_queue(
                topology.delay_queue(topology.delay_tiers_seconds[-1]), passive=True
            )
        except aio_pika.exceptions.ChannelClosed:
            return False
    return True


def line(
    reminder_id: str, destination: str, *, due_at: datetime | None = None, **fields: Any
) -> str:
    """One reminders-file line (a one-shot due now unless a schedule is given)."""
    data: dict[str, Any] = {
        "id": reminder_id,
        "channel": "webhook",
        "destination": destination,
        "payload": {"text": f"hello {reminder_id}"},
    }
    if not any(k in fields for k in ("daily_at", "cron")):
        data["due_at"] = (due_at or datetime.now(UTC)).isoformat()
    data.update(fields)
    return json.dumps(data)


async def load(pool: asyncpg.Pool, lines: list[str]) -> int:
    return await reminders.load(pool, lines, LOOPBACK)


async def states(pool: asyncpg.Pool) -> dict[str, int]:
    rows = await pool.fetch("SELECT state::text AS s, count(*) AS n FROM deliveries GROUP BY 1")
    return {r["s"]: r["n"] for r in rows}


async def lock_waiters(pool: asyncpg.Pool) -> int:
    """How many sessions of this database wait on a lock (a statement a test holds back)."""
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()"
        )
    )


async def waiting_on_a_lock(pool: asyncpg.Pool) -> bool:
    """Whether a session of this database waits on a lock (``lock_waiters``)."""
    return await lock_waiters(pool) > 0
