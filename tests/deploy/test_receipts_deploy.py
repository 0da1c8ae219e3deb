"""relay receipts on Kubernetes and in compose: probes and scrape on the routes it serves,
a Service in front, and its port open on its own pods only."""

from __future__ import annotations

import pytest
from opentelemetry.metrics import NoOpMeterProvider

from service.ops import receipts_server
from service.settings import Settings
from tests.deploy import support


def _routes() -> set[str]:
    metrics = receipts_server.ReceiptMetrics.create(NoOpMeterProvider().get_meter("test"))
    verifiers = receipts_server.Verifiers(sms_auth_token="x")

    def render(_accept: str | None) -> tuple[bytes, str]:
        return b"", "text/plain"

    app = receipts_server.build(None, verifiers, metrics, render)  # type: ignore[arg-type]
    return {route.resource.canonical for route in app.router.routes() if route.resource}


@pytest.mark.parametrize("kustomization", ["base", "overlays/example"])
def test_receipts_deployment_probes_service_and_ingress_match_what_it_serves(
    kustomization: str,
) -> None:
    objs = support.rendered(kustomization)
    deployment = support.find(objs, "Deployment", "relay-receipts")
    assert deployment["spec"]["replicas"] >= 2, "callbacks keep coming during a rollout"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert support.container_argv(container) == ["receipts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    port = int(env["RELAY_RECEIPTS_PORT"])
    assert port == Settings().receipts_port
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert list(ports.values()) == [port]
    routes = _routes()
    assert {receipts_server.EMAIL_PATH, receipts_server.SMS_PATH} <= routes
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for kind in ("readinessProbe", "livenessProbe"):
        get = container[kind]["httpGet"]
        assert get["path"] in routes and ports[get["port"]] == port, kind
    template = deployment["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in routes
    assert int(annotations["prometheus.io/port"]) == port
    labels = template["metadata"]["labels"]
    service = support.find(objs, "Service", "relay-receipts")
    assert service["spec"]["selector"].items() <= labels.items()
    targets = [ports.get(p["targetPort"], p["targetPort"]) for p in service["spec"]["ports"]]
    assert targets == [port]
    # Its port is admitted on its own pods, and on no other relay pod.
    policy = support.find(objs, "NetworkPolicy", "relay-receipts-ingress")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= labels.items()
    admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert admitted == {port}
    for other in (o for o in objs if o["kind"] == "Deployment" and o is not deployment):
        other_labels = other["spec"]["template"]["metadata"]["labels"]
        assert not selector.items() <= other_labels.items(), other["metadata"]["name"]
    general = support.find(objs, "NetworkPolicy", "relay-ingress")
    opened = {p["port"] for rule in general["spec"]["ingress"] for p in rule.get("ports", [])}
    assert port not in opened


def test_the_example_overlay_names_the_public_address_twilio_signs() -> None:
    config = support.config_data(support.rendered("overlays/example"))
    assert config["RELAY_RECEIPTS_PUBLIC_URL"].startswith("https://")


def test_compose_runs_relay_receipts_on_loopback_with_a_served_healthcheck() -> None:
    from tests.deploy import test_compose

    receipts = test_compose.services()["receipts"]
    assert support.parse_relay_args(receipts["command"], "receipts").command == "receipts"
    env = test_compose.environment(receipts)
    assert env["RELAY_RECEIPTS_HOST"] == "0.0.0.0"  # inside its container
    port = env["RELAY_RECEIPTS_PORT"]
    assert receipts["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert env["RELAY_EMAIL_WEBHOOK_SECRETS"].startswith("whsec_") and env["RELAY_SMS_AUTH_TOKEN"]
    check = " ".join(receipts["healthcheck"]["test"])
    assert f"http://127.0.0.1:{port}/readyz'" in check and "/readyz" in _routes()
    assert receipts["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
