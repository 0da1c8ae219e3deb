"""Every alert can be acted on and is tested both ways: each alert of
deploy/observability/alerts.yaml links to its own section of docs/operations.md (what it
means, the first three commands to run), the commands are real (``relay`` lines parse with the
real command line, ``kubectl`` lines name the namespace, objects and labels the manifests
create), and alerts*.test.yaml have a case in which the alert fires and one in which it stays
silent while reading its metrics. A new alert without all of these fails here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from tests.deploy import support
from tests.deploy.support import K8S, REPO, Obj

RUNBOOK = REPO / "docs" / "operations.md"
# The documented default base of every alert's runbook_url (docs/metrics.md, Alerts;
# scripts/alert-rules prints the rules under another).
RUNBOOK_BASE = "https://github.com/reminder-relay/reminder-relay/blob/main/docs/operations.md"
NAMESPACE = "reminder-relay"
MEANS = "**What it means.**"
FIRST_THREE = "**First three commands.**"
# Placeholders the prose uses inside commands, and a value each parses as.
PLACEHOLDERS = {
    "ID": "1",
    "N": "1",
    "URL": "https://partner.example/hook",
    "NAME": "x",
    "T": "2026-03-02T06:00:00+01:00",
}
# kubectl's short resource names -> the kind the manifests declare.
KINDS = {
    "cronjob": "CronJob",
    "deploy": "Deployment",
    "deployment": "Deployment",
    "svc": "Service",
    "service": "Service",
    "endpoints": "Service",  # a Service's endpoints carry its name
    "networkpolicy": "NetworkPolicy",
}

_FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_RELAY_METRIC = re.compile(r"(?<![\w:$])relay_[A-Za-z0-9_:]*")


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def alert_sections(text: str) -> dict[str, str]:
    """The ``###`` sections under ``## Alerts``: heading -> body."""
    _, _, alerts = text.partition("\n## Alerts\n")
    alerts = re.split(r"\n## ", alerts)[0]
    parts = re.split(r"^### (.+)$", alerts, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def first_commands(section: str) -> list[str]:
    """The command lines of the fenced block after **First three commands.**"""
    _, _, rest = section.partition(FIRST_THREE)
    fence = _FENCE.search(rest)
    if fence is None:
        return []
    lines = (shlex.split(line, comments=True) for line in fence.group(1).splitlines())
    return [shlex.join(argv) for argv in lines if argv]


def metrics_read(expr: str) -> set[str]:
    """The series names a rule's expression selects (``up`` included)."""
    names = set(_RELAY_METRIC.findall(expr))
    return names | ({"up"} if re.search(r"\bup\s*\{", expr) else set())


def coverage_problems(rules: list[Obj], cases: list[Obj], runbook: str) -> list[str]:
    """What keeps an alert from being acted on or from being tested both ways."""
    sections = alert_sections(runbook)
    problems = []
    names = [rule["alert"] for rule in rules if "alert" in rule]
    for rule in rules:
        name = rule["alert"]
        url = rule.get("annotations", {}).get("runbook_url", "")
        if url != f"{RUNBOOK_BASE}#{anchor(name)}":
            problems.append(f"{name}: runbook_url is not {RUNBOOK_BASE}#{anchor(name)}: {url}")
        body = sections.get(name)
        if body is None:
            problems.append(f"{name}: no section `### {name}` under Alerts in docs/operations.md")
        elif MEANS not in body or len(first_commands(body)) != 3:
            problems.append(f"{name}: its runbook section needs {MEANS} and three commands")
        problems += _test_problems(name, metrics_read(rule["expr"]), cases)
    problems += [
        f"docs/operations.md: section {s} names no alert" for s in sections.keys() - set(names)
    ]
    return problems


def _test_problems(name: str, metrics: set[str], cases: list[Obj]) -> list[str]:
    fires = silent = False
    for case in cases:
        fed = {s["series"].split("{")[0].strip("'\" ") for s in case.get("input_series", [])}
        for check in case.get("alert_rule_test", []):
            if check["alertname"] != name:
                continue
            if check.get("exp_alerts"):
                fires = True
            # Silent while reading its own metrics: a case with no input proves nothing.
            elif fed & metrics:
                silent = True
    problems = []
    if not fires:
        problems.append(f"{name}: no promtool case in which it fires")
    if not silent:
        problems.append(f"{name}: no promtool case, fed its metrics, in which it stays silent")
    return problems


def test_every_alert_has_a_runbook_section_and_is_tested_both_ways() -> None:
    rules = list(support.alert_rules())
    problems = coverage_problems(rules, list(support.alert_test_cases()), _runbook())
    assert problems == []


def test_a_new_alert_without_runbook_or_tests_is_reported() -> None:
    rules = list(support.alert_rules())
    new = {
        "alert": "RelaySomethingNew",
        "expr": "max by (namespace) (relay_deliveries) > 1",
        "annotations": {"runbook_url": f"{RUNBOOK_BASE}#relaysomethingnew"},
    }
    problems = coverage_problems([*rules, new], list(support.alert_test_cases()), _runbook())
    assert problems == [
        "RelaySomethingNew: no section `### RelaySomethingNew` under Alerts in docs/operations.md",
        "RelaySomethingNew: no promtool case in which it fires",
        "RelaySomethingNew: no promtool case, fed its metrics, in which it stays silent",
    ]
    # A silent check in a case that feeds none of the alert's metrics does not count.
    case = {
        "input_series": [{"series": 'relay_queue_depth{namespace="relay"}', "values": "0x5"}],
        "alert_rule_test": [{"eval_time": "5m", "alertname": "RelaySomethingNew"}],
    }
    assert coverage_problems([new], [case], "## Alerts\n")[-1].endswith("stays silent")


def test_the_runbook_table_links_every_section() -> None:
    text = _runbook()
    listed = re.findall(r"^\| \[(Relay\w+)\]\(#(\w+)\)", text, flags=re.M)
    assert [name for name, _ in listed] == list(alert_sections(text))
    assert all(link == anchor(name) for name, link in listed)
    assert sorted(alert_sections(text)) == sorted(r["alert"] for r in support.alert_rules())


def test_every_relay_command_in_the_runbook_parses() -> None:
    commands = [
        line for body in alert_sections(_runbook()).values() for line in first_commands(body)
    ]
    relay = [c for c in commands if c.startswith("relay ")]
    assert relay, "the runbook's first commands include relay commands"
    inline = [span for span in _code_spans() if re.match(r"relay [a-z]", span) and "…" not in span]
    for command in relay + inline:
        argv = [PLACEHOLDERS.get(w, w) for w in shlex.split(command, comments=True)[1:]]
        support.parse_relay_args(argv, f"docs/operations.md: {command}")


def test_every_kubectl_command_names_what_the_manifests_create() -> None:
    objects = _base_objects()
    names = {(obj["kind"], obj["metadata"]["name"]) for obj in objects}
    components = set(_label_values(objects, "app.kubernetes.io/component"))
    spans = [s for s in _code_spans() if "kubectl" in s]
    assert spans, "the runbook has kubectl commands"
    for span in spans:
        argv = shlex.split(span[span.index("kubectl") :], comments=True)
        if "-n" in argv:
            assert argv[argv.index("-n") + 1] == NAMESPACE, span
        for kind, name in re.findall(r"\b([a-z]+)/([a-z][a-z0-9-]*)\b", span):
            if kind in KINDS:
                assert (KINDS[kind], name) in names, f"{span}: no {KINDS[kind]} {name}"
        for component in re.findall(r"app\.kubernetes\.io/component=([a-z-]+)", span):
            assert component in components, f"{span}: no object labelled {component}"
    for body in alert_sections(_runbook()).values():
        for command in first_commands(body):
            if command.startswith("kubectl"):
                assert shlex.split(command)[1:3] == ["-n", NAMESPACE], command


# --- helpers -----------------------------------------------------------------------------


def _runbook() -> str:
    return RUNBOOK.read_text(encoding="utf-8")


def _code_spans() -> list[str]:
    """Every line of a fenced block and every inline code span of the runbook."""
    text = _runbook()
    spans = [line for block in _FENCE.findall(text) for line in block.splitlines() if line]
    prose = _FENCE.sub("", text)
    wrapped = [line for line in prose.splitlines() if line.count("`") % 2]
    assert wrapped == [], "docs/operations.md: keep each inline command on one line"
    spans += _INLINE.findall(prose)
    return spans


def _base_objects() -> list[Obj]:
    paths = sorted(Path(K8S / "base").glob("*.yaml"))
    return [
        doc
        for path in paths
        if path.name != "kustomization.yaml"
        for doc in support.load_docs(path)
    ]


def _label_values(node: Any, key: str) -> list[str]:
    """Every value of label ``key`` anywhere in the objects (pod and job templates too)."""
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "labels" and isinstance(v, dict) and key in v:
                found.append(v[key])
            found += _label_values(v, key)
    elif isinstance(node, list):
        for item in node:
            found += _label_values(item, key)
    return found
