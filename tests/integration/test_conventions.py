"""The ecosystem's conventions, checked on a real consumer process: ``/metrics`` passes
``promtool check metrics`` and is content-negotiated by ``prometheus_client``, label values
are snake_case, ``relay_build_info`` reports the version, the OpenTelemetry resource
honours ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``, and every log line is JSON
with an RFC 3339 UTC ``time``."""

from __future__ import annotations

import asyncio
import json
import platform
import re
import shutil
import signal
import socket
import subprocess
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service import conventions, db
from service.settings import Settings
from tests.support import broker
from tests.support import relay as rs
from tests.support.relay import RunningPartner

SNAKE = re.compile(r"^[a-z0-9]+(_[a-z0-9]+)*$")
RFC3339_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")
OPENMETRICS = "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, accept: str | None = None) -> tuple[str, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if accept is not None:
        request.add_header("Accept", accept)
    with urllib.request.urlopen(request, timeout=5) as answer:
        return answer.headers["Content-Type"], answer.read().decode()


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


@pytest.mark.timeout(120)
async def test_live_scrape_follows_prometheus_and_opentelemetry_conventions(
    settings: Settings,
    pool: asyncpg.Pool,
    partner: RunningPartner,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is required (Debian's prometheus package)"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "relay-from-env")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=conventions")
    await rs.load(pool, [rs.line(f"ok{i}", partner.url("ok")) for i in range(3)])
    await broker.declare(settings)
    # Poison with reasons that are phrases: each label value must come out snake_case.
    await broker.publish_raw(
        settings, [b"this is not JSON {", b'{"v": 1, "delivery_id": 987654321}']
    )
    assert (await rs.relay(settings, "publish")).code == 0
    port = _free_port()
    log = tmp_path / "consumer.log"
    consumer = await rs.start_consumer(
        settings, log, HEALTH_PORT=str(port), HEALTH_HOST="127.0.0.1"
    )
    try:

        async def settled() -> bool:
            if (await rs.states(pool)).get("delivered", 0) != 3:
                return False
            try:
                _, text = await asyncio.to_thread(_get, port)
            except OSError:
                return False
            return sum(v for n, _, v in _samples(text) if n == "relay_delivery_poison_total") == 2

        await rs.wait_for(settled, 60, "3 delivered and 2 poison counted")
        content_type, text = await asyncio.to_thread(_get, port)
        om_type, om_text = await asyncio.to_thread(_get, port, OPENMETRICS)
    finally:
        consumer.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(consumer.wait(), 30) == 0

    # Content negotiation by prometheus_client: text 0.0.4 by default, OpenMetrics on ask.
    assert content_type.startswith("text/plain; version=0.0.4")
    assert om_type.startswith("application/openmetrics-text")
    assert om_text.rstrip().endswith("# EOF")
    checked = await asyncio.to_thread(
        subprocess.run,
        [promtool, "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr

    samples = _samples(text)
    (build,) = [labels for n, labels, v in samples if n == "relay_build_info" and v == 1]
    assert build["version"] == conventions.version() and build["python"] == (
        platform.python_version()
    )
    reasons = {labels["reason"] for n, labels, _ in samples if "reason" in labels}
    assert {"undecodable_body", "unknown_delivery_id"} <= reasons
    assert all(SNAKE.match(r) for r in reasons), reasons
    # The resource comes from the SDK's environment detection.
    (target,) = [labels for n, labels, _ in samples if n == "target_info"]
    assert target["service_name"] == "relay-from-env"
    assert target["deployment_environment_name"] == "conventions"

    lines = log.read_text().splitlines()
    assert lines
    for line in lines:
        entry = json.loads(line)  # every line is JSON, libraries' included
        assert RFC3339_UTC.match(entry["time"]), entry["time"]
        parsed = datetime.fromisoformat(entry["time"])
        assert parsed.utcoffset() is not None and parsed.utcoffset() == UTC.utcoffset(None)


@pytest.mark.timeout(120)
async def test_concurrent_migrates_on_an_empty_database_apply_each_migration_once(
    settings: Settings,
) -> None:
    """What every rollout does (deploy/k8s: an initContainer `relay migrate` on each new
    consumer pod, several at once with a surge or KEDA): all succeed, each applied once,
    and a later run applies nothing."""
    name = f"relay_t_empty_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = urlunsplit(urlsplit(settings.database_url.get_secret_value())._replace(path=f"/{name}"))
    try:
        results = await asyncio.gather(
            *(rs.relay(settings, "migrate", DATABASE_URL=url) for _ in range(4))
        )
        assert [r.code for r in results] == [0, 0, 0, 0], [r.stderr for r in results]
        conn = await asyncpg.connect(url)
        try:
            versions = [
                r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")
            ]
        finally:
            await conn.close()
        assert sorted(versions) == [v for v, _ in db.migrations()]
        again = await rs.relay(settings, "migrate", DATABASE_URL=url)
        assert again.code == 0, again.stderr
    finally:
        admin = await asyncpg.connect(settings.database_url.get_secret_value())
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
