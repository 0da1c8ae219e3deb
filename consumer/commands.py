"""Handler of ``relay consume``."""

from __future__ import annotations

import argparse

from consumer import build, health
from consumer import run as consume_run
from service import conventions, telemetry
from service.settings import Settings


async def consume(args: argparse.Namespace, settings: Settings) -> int:
    # Every setting is checked before a server is opened, with or without --check.
    build.validate(settings)
    if args.check:
        return await consume_run.check(settings)
    health.check_health_port(settings)
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY

    telem = telemetry.setup("relay-consume", [PrometheusMetricReader()])
    # A setting, not a ledger fact: RelayPurgeNotRunning compares the last purge with it.
    telem.metrics.snapshot.purge_period_seconds = settings.retention_purge_period_hours * 3600
    try:
        return await consume_run.run(
            settings,
            metrics=telem.metrics,
            tracer=telem.tracer,
            render_metrics=lambda accept: conventions.render_prometheus(REGISTRY, accept),
        )
    finally:
        telem.shutdown()
