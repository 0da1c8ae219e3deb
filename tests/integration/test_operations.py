"""Operations: metrics that match the ledger, traces across the broker, private logs,
and a run report that says exactly who did not get it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import urllib.request
from pathlib import Path

import aio_pika
import asyncpg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from publisher import run as publish_run
from service import amqp, telemetry
from service.clock import SystemClock
from service.ops import partner as partner_mod
from service.settings import Settings
from tests.conftest import SECRET
from tests.support import forked
from tests.support import relay as rs
from tests.support.relay import RunningPartner


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in sample.labels.items() if not k.startswith("otel_"))
            )
            samples[(sample.name, labels)] = sample.value
    return samples


def _sum(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **match: str
) -> float:
    return sum(
        v
        for (n, labels), v in samples.items()
        if n == name and all((k, val) in labels for k, val in match.items())
    )


async def _final(pool: asyncpg.Pool, n: int) -> bool:
    states = await rs.states(pool)
    return states.get("delivered", 0) + states.get("dead", 0) == n


async def test_scraped_metrics_match_the_ledger_after_a_run_with_faults(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    partner.state.rules["flaky"] = partner_mod.PathRule(status=503, first_n_per_key=1)
    partner.state.rules["bad"] = partner_mod.PathRule(status=400)
    lines = [rs.line(f"ok{i}", partner.url("ok")) for i in range(250)]
    lines += [rs.line(f"flaky{i}", partner.url("flaky")) for i in range(30)]
    lines += [rs.line(f"bad{i}", partner.url("bad")) for i in range(20)]
    await rs.load(pool, lines)
    assert (await rs.relay(settings, "publish")).code == 0
    port = _free_port()
    # All paths share the partner's host:port; keep its circuit closed through the 503s.
    consumer = await rs.start_consumer(
        settings,
        HEALTH_PORT=str(port),
        HEALTH_HOST="127.0.0.1",
        METRICS_SAMPLE_SECONDS="0.3",
        BREAKER_FAILURE_THRESHOLD="1000",
    )
    try:
        await rs.wait_for(lambda: _final(pool, 300), 60, "every delivery final")
        ledger_states = await rs.states(pool)

        async def gauges_caught_up() -> bool:
            # The state gauges and the run's completion ratio are sampled apart: a scrape
            # between the two samples saw an older ratio on a loaded machine.
            samples = await asyncio.to_thread(_scrape, port)
            delivered = ledger_states.get("delivered", 0)
            return _sum(samples, "relay_run_completion_ratio") == delivered / 300 and all(
                _sum(samples, "relay_deliveries", state=s) == n for s, n in ledger_states.items()
            )

        await rs.wait_for(gauges_caught_up, 10, "state gauges refreshed")
        samples = await asyncio.to_thread(_scrape, port)
        ready = await asyncio.to_thread(
            urllib.request.urlopen, f"http://127.0.0.1:{port}/readyz", None, 5
        )
        assert json.loads(ready.read())["status"] == "ready"
    finally:
        consumer.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(consumer.wait(), 30) == 0

    by_outcome = {
        r["outcome"]: r["n"]
        for r in await pool.fetch(
            "SELECT outcome, count(*) AS n FROM delivery_attempts GROUP BY outcome"
        )
    }
    assert by_outcome == {"accepted": 280, "retry": 30, "rejected": 20}
    for outcome, n in by_outcome.items():
        assert _sum(samples, "relay_delivery_attempts_total", outcome=outcome) == n, outcome
    assert _sum(samples, "relay_delivery_dead_letters_total") == ledger_states["dead"] == 20
    assert _sum(samples, "relay_delivery_retries_total") == by_outcome["retry"]
    assert _sum(samples, "relay_delivery_send_duration_seconds_count") == 330
    assert _sum(samples, "relay_consumer_ready") == 1
    assert _sum(samples, "relay_deliveries_oldest_claimable_age_seconds") == 0
    assert _sum(samples, "relay_run_completion_ratio") == 280 / 300


async def test_every_delivery_attempt_span_links_to_the_publish_run_span(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    partner.state.rules["flaky"] = partner_mod.PathRule(status=503, first_n_per_key=1)
    await rs.load(
        pool,
        [rs.line(f"r{i}", partner.url("ok")) for i in range(5)]
        + [rs.line("again", partner.url("flaky"))],
    )
    result = await publish_run.run(
        settings, metrics=telemetry.noop(), clock=SystemClock(), tracer=tracer
    )
    assert result.counts.published == 6
    async with rs.consumer_in_process(settings, tracer=tracer):
        await rs.wait_for(lambda: _final(pool, 6), 20, "all delivered")
    spans = exporter.get_finished_spans()
    (run_span,) = [s for s in spans if s.name == "relay publish run"]
    topology = amqp.Topology.from_settings(settings)
    queue = topology.lane_queue(amqp.BULK)
    attempts = [s for s in spans if s.name == f"process {queue}"]
    assert len(attempts) == 7  # 6 first attempts + 1 retry, each linked to the run
    for span in attempts:
        # Its own trace, not a child of the run: linked to it (batch -> message).
        assert span.parent is None and span.context.trace_id != run_span.context.trace_id
        assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [
            (run_span.context.trace_id, run_span.context.span_id)
        ]
        assert span.attributes["messaging.system"] == "rabbitmq"
        assert span.attributes["messaging.operation.name"] == "process"
        assert span.attributes["messaging.operation.type"] == "process"
        assert span.attributes["messaging.destination.name"] == topology.work_exchange
        assert span.attributes["messaging.destination.subscription.name"] == queue
        assert isinstance(span.attributes["relay.delivery_id"], int)
    assert len({s.context.trace_id for s in attempts}) == 7
    everything = json.dumps([dict(s.attributes or {}) for s in spans])
    assert "127.0.0.1" not in everything and "hello" not in everything


async def test_status_missing_lists_exactly_the_deliveries_not_delivered(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner
) -> None:
    partner.state.rules["down"] = partner_mod.PathRule(status=503)
    partner.state.rules["bad"] = partner_mod.PathRule(status=410)
    lines = [rs.line(f"ok{i}", partner.url("ok")) for i in range(8)]
    lines += [rs.line("down1", partner.url("down")), rs.line("bad1", partner.url("bad"))]
    await rs.load(pool, lines)
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings.model_copy(update={"retry_base_seconds": 60})):
        await rs.wait_for(lambda: _counts(pool, delivered=8, dead=1, retrying=1), 20, "settled")
    run_id = await pool.fetchval("SELECT max(id) FROM publish_runs")
    report = await rs.relay(settings, "status", "--run", str(run_id), "--missing", "--json")
    assert report.code == 0, report.stderr
    missing = json.loads(report.stdout)["missing"]
    expected = await pool.fetch(
        "SELECT id, reminder_id, state::text AS state FROM deliveries"
        " WHERE state <> 'delivered' ORDER BY id"
    )
    assert [(m["id"], m["reminder_id"], m["state"]) for m in missing] == [
        (r["id"], r["reminder_id"], r["state"]) for r in expected
    ]
    by_reminder = {m["reminder_id"]: m for m in missing}
    assert by_reminder["down1"]["last_status"] == 503
    assert by_reminder["down1"]["next_attempt_at"] is not None
    assert by_reminder["bad1"]["last_status"] == 410
    table = await rs.relay(settings, "status", "--run", str(run_id), "--missing")
    assert "down1" in table.stdout and "bad1" in table.stdout and "ok1" not in table.stdout
    summary = await rs.relay(settings, "status", "--json")
    run = json.loads(summary.stdout)["runs"][0]
    assert (run["due"], run["delivered"], run["states"]["dead"]) == (10, 8, 1)
    assert run["completion_ratio"] == 0.8


async def _counts(pool: asyncpg.Pool, **expected: int) -> bool:
    states = await rs.states(pool)
    return all(states.get(k, 0) == v for k, v in expected.items())


async def test_demo_logs_hold_no_addresses_payloads_or_secrets(
    settings: Settings, tmp_path: Path
) -> None:
    result = await rs.relay(
        settings,
        "demo",
        "--reminders",
        "200",
        timeout=240,
        STATE_DIR=str(tmp_path),
        LOG_LEVEL="DEBUG",
    )
    assert result.code == 0, result.stderr[-3000:]
    assert "logical events=" in result.stdout
    logs = [p.read_text() for p in (tmp_path / "demo").glob("*/*.log")]  # demo/<run>/
    logs.append(result.stderr)
    lines = [line for text in logs for line in text.splitlines() if line.strip()]
    assert len(lines) > 200  # the consumers did log every attempt
    events = [json.loads(line) for line in lines if line.startswith("{")]
    attempts = [e for e in events if e.get("event") == "attempt"]
    assert len(attempts) >= 200
    for e in attempts:
        assert {"delivery_id", "key", "run_id", "attempt"} <= set(e), e
    text = "\n".join(lines)
    for forbidden in (
        "127.0.0.1:",
        "/hooks/",
        "Reminder ",
        "whsec_",
        SECRET[6:20],
        "guest:guest",
        "postgresql://",
        "amqp://",
    ):
        assert forbidden not in text, forbidden


_DEMO_RUN = re.compile(r"^-- this run: database (relay_demo_[0-9a-f]+), broker namespace (\S+),")


async def _demo_leftovers(settings: Settings, stdout: str) -> list[str]:
    """What of a demo run (named on its first lines) is still on the shared servers: its
    database, its work queue, a process started with its namespace."""
    found = _DEMO_RUN.search(stdout.split("\n", 2)[1])
    assert found, stdout[:500]
    database, namespace = found.groups()
    left = []
    conn = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        if await conn.fetchval("SELECT count(*) FROM pg_database WHERE datname = $1", database):
            left.append(f"database {database}")
    finally:
        await conn.close()
    topology = amqp.Topology.from_settings(
        settings.model_copy(update={"amqp_namespace": namespace})
    )
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value(), timeout=10)
    async with connection:
        channel = await connection.channel()
        with contextlib.suppress(aio_pika.exceptions.ChannelNotFoundEntity):
            await channel.declare_queue(topology.lane_queue(amqp.BULK), passive=True)
            left.append(f"queue {topology.lane_queue(amqp.BULK)}")
    marker = f"RELAY_AMQP_NAMESPACE={namespace}".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                left.append(f"process {proc.name}")
    return left


@pytest.mark.timeout(300)  # 77 s with two suites at once on a slow VM (alone: 33)
async def test_two_demos_at_once_on_the_same_servers_both_deliver_and_leave_nothing(
    settings: Settings, tmp_path: Path
) -> None:
    # 30 reminders each: demo-00007 fails once (503) then is delivered, demo-00013 is
    # rejected (400, dead): 29 logical events per run, at the partner of that run.
    runs = await asyncio.gather(
        *(
            rs.relay(
                settings,
                "demo",
                *("--reminders", "30", "--consumers", "1"),
                timeout=240,
                STATE_DIR=str(tmp_path),
            )
            for _ in range(2)
        )
    )
    for run in runs:
        assert run.code == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert "logical events=29 duplicates=0 bad signatures=0" in run.stdout, run.stdout
        assert "-- run report (relay status)" in run.stdout
        assert await _demo_leftovers(settings, run.stdout) == [], run.stdout[-1500:]
    first, second = (_DEMO_RUN.search(r.stdout.split("\n", 2)[1]) for r in runs)
    assert first and second and first.groups() != second.groups()


async def test_an_interrupted_demo_removes_its_database_namespace_and_processes(
    settings: Settings, tmp_path: Path
) -> None:
    demo = await asyncio.create_subprocess_exec(
        *forked.relay_command("demo", "--reminders", "2000"),
        # A pytest-xdist worker ignores SIGINT and a child inherits that: as from a shell,
        # the demo must start with Ctrl-C's default action (Python's KeyboardInterrupt).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        env=rs.env_for(settings, STATE_DIR=str(tmp_path)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=rs.REPO,
    )
    assert demo.stdout is not None
    seen = b""
    while b"-- starting 2 consumers" not in seen:  # its topology declared, consumers up
        line = await asyncio.wait_for(demo.stdout.readline(), 120)
        assert line, seen.decode()
        seen += line
    demo.send_signal(signal.SIGINT)  # Ctrl-C
    rest, _ = await asyncio.wait_for(demo.communicate(), 120)
    assert demo.returncode == 130
    said = (seen + rest).decode()
    assert await _demo_leftovers(settings, said) == [], said[-1500:]
