"""The observability files (deploy/observability, docs/metrics.md): the alert rules are valid
and pass their promtool unit tests, and every metric an alert or a dashboard panel queries is
one the code exports, computed from service/telemetry.py itself so the two cannot drift.
Runbook sections and the firing / silent case of every alert: test_alert_runbook.py."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Counter, Histogram
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service import gauges, telemetry
from tests.deploy import support
from tests.deploy.support import ALERT_TESTS, ALERTS, DEPLOY, K8S, REPO, Obj, alert_rules

DASHBOARD = DEPLOY / "observability" / "dashboard.json"
METRICS_DOC = REPO / "docs" / "metrics.md"

# Grafana's interval variables, replaced by a duration so promtool can parse the expression;
# the dashboard's own variables by their "All" value.
GRAFANA_INTERVALS = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$namespace": ".*",
    "$job": ".*",
}

_PROMQL_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_RELAY_METRIC = re.compile(r"(?<![\w:$])relay_[A-Za-z0-9_:]*")


# --- what the code exports -----------------------------------------------------------------


def _fill(value: Any) -> Any:
    """A non-empty value of a Snapshot field's kind, so its gauge reports a sample."""
    if isinstance(value, dict):
        return {"relay.deliveries": 1}
    if isinstance(value, bool):
        return True
    return 1.0


@cache
def exported() -> dict[str, str]:
    """Every sample name the consumer's /metrics can show -> its family type.

    Built the way the consumer builds it (``telemetry.setup`` with a
    ``PrometheusMetricReader``), in a private registry so nothing is registered globally,
    with a value recorded into every counter and histogram and every Snapshot field set.
    """
    registry = CollectorRegistry(auto_describe=True)
    telem = telemetry.setup(
        "relay-observability-test", [PrometheusMetricReader(registry=registry)], environ={}
    )
    try:
        metrics = telem.metrics
        for f in dataclasses.fields(metrics):
            instrument = getattr(metrics, f.name)
            if isinstance(instrument, Counter | telemetry.LocalCounter):
                instrument.add(1, {"channel": "webhook", "provider": "webhook"})
            elif isinstance(instrument, Histogram):
                instrument.record(0.5, {"channel": "webhook", "provider": "webhook"})
            elif isinstance(instrument, gauges.Snapshot):
                for sf in dataclasses.fields(instrument):
                    setattr(instrument, sf.name, _fill(getattr(instrument, sf.name)))
            else:
                pytest.fail(
                    f"Metrics.{f.name} is a {type(instrument).__name__}: teach "
                    "tests/deploy/test_observability.py to record into it"
                )
        text = generate_latest(registry).decode()
    finally:
        telem.shutdown()
    names: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("relay_"):
                names[sample.name] = family.type
    return names


def families() -> set[str]:
    """Exported metric names as documented: counters with _total, histograms without suffix."""
    out = set()
    for name, kind in exported().items():
        if kind == "histogram":
            name = re.sub(r"_(bucket|sum|count)$", "", name)
        out.add(name)
    return out


def test_every_instrument_is_exported() -> None:
    counters = histograms = 0
    metrics = telemetry.noop()
    for f in dataclasses.fields(metrics):
        instrument = getattr(metrics, f.name)
        counters += isinstance(instrument, Counter | telemetry.LocalCounter)
        histograms += isinstance(instrument, Histogram)
    kinds = exported()
    # Besides the instruments: the counters read from the ledger (relay_purge_rows_total).
    counters += len(gauges.SNAPSHOT_COUNTERS)
    assert sum(1 for k in kinds.values() if k == "counter") == counters
    assert sum(1 for n, k in kinds.items() if k == "histogram" and n.endswith("_count")) == (
        histograms
    )
    # The gauges (one per Snapshot-backed observable) are exported under their own names.
    assert {"relay_consumer_ready", "relay_deliveries", "relay_queue_depth"} <= set(kinds)


# --- PromQL ---------------------------------------------------------------------------------


def metric_names(expr: str) -> set[str]:
    """The relay_* metric names an expression selects (string literals ignored)."""
    return set(_RELAY_METRIC.findall(_PROMQL_STRING.sub('""', expr)))


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le) (rate(relay_a_bucket{queue=~"relay_x"}[5m])))'
        " / on () relay_b_total offset 5m and relay_c:rate5m"
    )
    assert metric_names(expr) == {"relay_a_bucket", "relay_b_total", "relay_c:rate5m"}


def promtool() -> str:
    found = shutil.which("promtool") or (
        "/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None
    )
    if found is None:
        pytest.fail(
            "promtool is not installed: install Debian's `prometheus` package, which ships "
            "/usr/bin/promtool (as root: apt-get install prometheus; scripts/test does it "
            "when run as root)"
        )
    return found


def run_promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=240, check=False
    )


# --- alert rules ----------------------------------------------------------------------------


def test_alert_rules_are_valid() -> None:
    result = run_promtool("check", "rules", "--lint-fatal", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(300)  # 74 s with two suites at once on a slow VM (alone: under 33)
def test_alert_rules_pass_their_unit_tests() -> None:
    result = run_promtool("test", "rules", *map(str, ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_query_only_exported_metrics() -> None:
    known = set(exported())
    for rule in alert_rules():
        used = metric_names(rule["expr"])
        assert used or "up{" in rule["expr"], f"{rule['alert']}: queries no relay metric"
        assert used <= known, f"{rule['alert']}: not exported by the code: {used - known}"


def test_alert_rules_are_complete() -> None:
    # Runbook links and sections: tests/deploy/test_alert_runbook.py.
    for rule in alert_rules():
        name = rule.get("alert")
        assert name, f"only alerting rules belong in alerts.yaml: {rule}"
        assert rule.get("for"), f"{name}: needs `for:`"
        assert rule.get("labels", {}).get("severity") in ("warning", "critical"), name
        notes = rule.get("annotations", {})
        assert notes.get("summary") and notes.get("description"), name


_AGGREGATION = re.compile(r"\b(sum|max|min|avg|count)\s*(?:by\s*\(([^)]*)\))?\s*\(")
_ON = re.compile(r"\bon\s*\(([^)]*)\)\s*(\w*)")


def test_alert_rules_aggregate_by_namespace() -> None:
    for rule in alert_rules():
        expr = _PROMQL_STRING.sub('""', rule["expr"])
        for match in _AGGREGATION.finditer(expr):
            grouping = [label.strip() for label in (match.group(2) or "").split(",")]
            assert "namespace" in grouping, f"{rule['alert']}: {match.group(0)} not by namespace"
        for match in _ON.finditer(expr):
            matching = [label.strip() for label in match.group(1).split(",")]
            # absent() has no labels to match on: only there is `on ()` right.
            assert "namespace" in matching or match.group(2) == "absent", rule["alert"]


def test_alert_rules_under_another_runbook_base(tmp_path: Path) -> None:
    base = "https://git.example.com/ops/relay/-/blob/main/docs/operations.md"
    printed = subprocess.run(
        [str(REPO / "scripts" / "alert-rules"), base],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    rules = tmp_path / "rules.yaml"
    rules.write_text(printed)
    groups = yaml.safe_load(printed)["groups"]
    urls = [r["annotations"]["runbook_url"] for g in groups for r in g["rules"]]
    assert len(urls) == len(alert_rules())
    assert all(url.startswith(base + "#relay") for url in urls), urls
    result = run_promtool("check", "rules", "--lint-fatal", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    relative = subprocess.run(
        [str(REPO / "scripts" / "alert-rules"), "docs/operations.md"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert relative.returncode == 2 and "absolute" in relative.stderr


def test_scrape_job_in_alerts_is_the_metrics_service() -> None:
    service = support.load_docs(K8S / "base" / "consumer-service.yaml")[0]
    jobs = {
        job for rule in alert_rules() for job in re.findall(r'\bjob\s*=\s*"([^"]+)"', rule["expr"])
    }
    assert jobs == {service["metadata"]["name"]}


# --- dashboard ------------------------------------------------------------------------------


@cache
def dashboard() -> Obj:
    data: Obj = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def panels() -> list[Obj]:
    """Every panel, including those nested in collapsed rows."""
    out = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def query_panels() -> list[Obj]:
    return [p for p in panels() if p.get("type") != "row"]


def test_dashboard_structure() -> None:
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41
    assert board.get("uid") and board.get("title")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "job"):
        variable = variables[name]
        assert variable["type"] == "query" and variable["includeAll"], name
        assert variable["allValue"] == ".*", f"{name}: All must match series without the label"
        assert f", {name})" in variable["definition"], name
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    assert query_panels(), "no panels"


@pytest.mark.parametrize("panel", query_panels(), ids=lambda p: p["title"])
def test_dashboard_panel(panel: Obj) -> None:
    assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    targets = panel.get("targets", [])
    assert targets, "no targets"
    refs = [t["refId"] for t in targets]
    assert len(refs) == len(set(refs)), "duplicate refIds"
    known = set(exported())
    for target in targets:
        assert target.get("datasource", panel["datasource"]) == panel["datasource"]
        used = metric_names(target["expr"])
        assert used, f"{target['refId']}: queries no relay metric"
        assert used <= known, f"{target['refId']}: not exported by the code: {used - known}"
    grid = panel["gridPos"]
    assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24


def test_every_dashboard_query_is_scoped_to_the_namespace_and_job_variables() -> None:
    selector = re.compile(r"(relay_[A-Za-z0-9_:]*)(\{[^}]*\})?")
    for panel in query_panels():
        for target in panel["targets"]:
            for name, matchers in selector.findall(target["expr"]):
                assert 'namespace=~"$namespace"' in matchers, f"{panel['title']}: {name}"
                assert 'job=~"$job"' in matchers, f"{panel['title']}: {name}"


def test_dashboard_shows_delivery_lateness_p50_and_p95_by_lane() -> None:
    (panel,) = [p for p in query_panels() if p["title"] == "Delivery lateness p50 / p95 by lane"]
    exprs = [t["expr"] for t in panel["targets"]]
    assert [e.split(",")[0] for e in exprs] == [
        "histogram_quantile(0.5",
        "histogram_quantile(0.95",
    ]
    for expr in exprs:
        assert metric_names(expr) == {"relay_delivery_lateness_seconds_bucket"}
        assert "sum by (lane, le)" in expr


def test_dashboard_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_dashboard_expressions_are_valid_promql(tmp_path: Path) -> None:
    # promtool parses PromQL only inside rule files: check each expression as a recording rule.
    rules = []
    for panel in query_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, duration in GRAFANA_INTERVALS.items():
                expr = expr.replace(variable, duration)
            assert "$" not in expr, f"{panel['title']}: unknown Grafana variable in {expr}"
            rules.append(
                {"record": f"dashboard:panel{panel['id']}:{target['refId']}", "expr": expr}
            )
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# --- docs/metrics.md ------------------------------------------------------------------------


def test_metrics_doc_lists_every_exported_metric() -> None:
    text = METRICS_DOC.read_text(encoding="utf-8")
    missing = sorted(name for name in families() if f"`{name}`" not in text)
    assert not missing, f"docs/metrics.md does not list: {missing}"
