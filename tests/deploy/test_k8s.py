"""The Kubernetes manifests (deploy/k8s): they parse, validate, build, and run real commands."""

from __future__ import annotations

import ipaddress
import os
import zoneinfo
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from croniter import croniter

from consumer import health
from service import amqp, errors, netpolicy, settings, telemetry
from service.settings import Settings
from tests.deploy import support
from tests.deploy.support import K8S, Obj

# Oldest supported Kubernetes (Job podFailurePolicy GA) and the newest schema shipped.
K8S_VERSIONS = ["1.31.0", kubernetes_validate.utils.latest_version()]
CRD_GROUPS = ("keda.sh/",)  # custom resources: no schema ships; checked structurally below


def manifest_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


# --- parsing and schema -----------------------------------------------------------------


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_parses(path: Path) -> None:
    docs = support.load_docs(path)
    assert docs, f"{path} has no YAML document"
    for doc in docs:
        assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), (
            f"{path}: every document needs apiVersion and kind"
        )
        if doc["kind"] not in ("Kustomization", "Component"):
            assert doc.get("metadata", {}).get("name"), f"{path}: {doc['kind']} without a name"


def test_all_kustomization_dirs_are_checked() -> None:
    found = {p.relative_to(K8S).as_posix() for p in kustomization_dirs()}
    components = {
        p.relative_to(K8S).as_posix()
        for p in kustomization_dirs()
        if support.load_docs(p / "kustomization.yaml")[0]["kind"] == "Component"
    }
    assert found - components == set(support.KUSTOMIZATIONS)


def _resource_files(directory: Path, seen: set[Path] | None = None) -> list[Path]:
    """Files listed as resources, following directories and components (not patches)."""
    seen = set() if seen is None else seen
    kustomization = support.load_docs(directory / "kustomization.yaml")[0]
    files: list[Path] = []
    for entry in [*kustomization.get("resources", []), *kustomization.get("components", [])]:
        target = (directory / entry).resolve()
        if target in seen:
            continue
        seen.add(target)
        files += _resource_files(target, seen) if target.is_dir() else [target]
    return files


def _schema_validate(obj: Obj, version: str, where: str) -> None:
    if str(obj["apiVersion"]).startswith(CRD_GROUPS):
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(
            f"{where} {support.kind_name(obj)} (Kubernetes {version}): {path}: {exc.message}"
        )
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"{where}: {exc.message}")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_resource_files_validate_against_kubernetes_schema(version: str) -> None:
    files = {f for d in kustomization_dirs() for f in _resource_files(d)}
    assert files
    for path in sorted(files):
        for obj in support.load_docs(path):
            _schema_validate(obj, version, str(path.relative_to(K8S)))


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kustomization", support.KUSTOMIZATIONS)
def test_rendered_objects_validate_against_kubernetes_schema(
    kustomization: str, version: str
) -> None:
    for obj in support.rendered(kustomization):
        _schema_validate(obj, version, f"kustomize build {kustomization}:")


# --- kustomize --------------------------------------------------------------------------


@pytest.mark.parametrize("kustomization", support.KUSTOMIZATIONS)
def test_kustomize_builds(kustomization: str) -> None:
    objs = support.rendered(kustomization)
    assert objs
    names = [support.kind_name(o) for o in objs]
    assert len(names) == len(set(names)), f"duplicate objects in {kustomization}: {names}"


def test_kustomization_references_resolve() -> None:
    """Structural check without kustomize: every referenced file exists, every patch has a
    target among the resources it patches, images name the image the manifests use."""
    for directory in kustomization_dirs():
        doc = support.load_docs(directory / "kustomization.yaml")[0]
        where = directory.relative_to(K8S)
        for entry in [*doc.get("resources", []), *doc.get("components", [])]:
            target = directory / entry
            assert target.exists(), f"{where}: {entry} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").exists(), (
                    f"{where}: {entry} not a kustomization"
                )
        for image in doc.get("images", []):
            assert image["name"] == support.IMAGE_NAME, (
                f"{where}: images must rewrite {support.IMAGE_NAME}"
            )
        resources = [o for f in _resource_files(directory) for o in support.load_docs(f)]
        if doc["kind"] == "Component" and doc.get("patches"):
            parent = directory.parent
            resources += [o for f in _resource_files(parent) for o in support.load_docs(f)]
        for patch in doc.get("patches", []):
            if "path" in patch:
                assert (directory / patch["path"]).exists(), f"{where}: {patch['path']} missing"
                body = support.load_docs(directory / patch["path"])[0]
                kind, name = body["kind"], body["metadata"]["name"]
            else:
                kind, name = patch["target"]["kind"], patch["target"]["name"]
            assert any(o["kind"] == kind and o["metadata"]["name"] == name for o in resources), (
                f"{where}: patch targets {kind}/{name}, which none of its resources defines"
            )


@pytest.mark.parametrize("kustomization", support.KUSTOMIZATIONS)
def test_every_object_lands_in_the_namespace(kustomization: str) -> None:
    for obj in support.rendered(kustomization):
        if obj["kind"] == "Namespace":
            assert obj["metadata"]["name"] == "reminder-relay"
        else:
            assert obj["metadata"].get("namespace") == "reminder-relay", support.kind_name(obj)


def test_overlay_sets_a_registry_image() -> None:
    for _, obj in support.all_rendered():
        for _, spec in support.workloads([obj]):
            for container in spec["containers"]:
                assert "reminder-relay:" in container["image"], container["image"]
    for obj, spec in support.workloads(support.rendered("overlays/example")):
        for container in spec["containers"]:
            assert container["image"].startswith("registry.example.com/"), support.kind_name(obj)


# --- commands and settings --------------------------------------------------------------


def test_every_container_runs_a_real_relay_command() -> None:
    commands = set()
    for name, obj in support.all_rendered():
        for _, spec in support.workloads([obj]):
            for container in spec["containers"] + spec.get("initContainers", []):
                argv = support.container_argv(container)
                args = support.parse_relay_args(argv, f"{name}: {support.kind_name(obj)}")
                commands.add(args.command)
    assert commands == {"consume", "publish", "migrate", "replay", "console", "receipts", "purge"}


def test_env_vars_are_real_settings() -> None:
    known = support.setting_variables()
    for name, obj in support.all_rendered():
        where = f"{name}: {support.kind_name(obj)}"
        if obj["kind"] == "ConfigMap":
            keys = set(obj.get("data", {}))
        elif obj["kind"] == "Secret":
            keys = set(obj.get("stringData", {})) | set(obj.get("data", {}))
        else:
            keys = {
                env["name"]
                for _, spec in support.workloads([obj])
                for c in spec["containers"]
                for env in c.get("env", [])
            }
        relay_keys = {k for k in keys if k.startswith("RELAY_")}
        assert relay_keys == keys or obj["kind"] not in ("ConfigMap", "Secret"), where
        assert relay_keys <= known, f"{where}: not settings: {sorted(relay_keys - known)}"


def test_credentials_only_in_the_secret() -> None:
    objs = support.rendered("overlays/example")
    config = support.config_data(objs)
    secret = support.find(objs, "Secret", "relay-secrets")
    secret_keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    assert not support.secret_variables() & set(config), "credentials in the ConfigMap"
    assert secret_keys == support.secret_variables()
    for value in secret.get("stringData", {}).values():
        assert "REPLACE_ME" in value, "the example Secret must hold placeholders only"


@pytest.mark.parametrize("kustomization", ["base", "overlays/example"])
def test_configmap_and_secret_values_load(
    kustomization: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settings load from the ConfigMap's values and the Secret mounted as files."""
    objs = support.rendered(kustomization)
    secrets = [o for o in objs if o["kind"] == "Secret"]
    string_data = secrets[0]["stringData"] if secrets else {}
    for key, value in string_data.items():
        (tmp_path / key).write_text(value + "\n", encoding="utf-8")
    for key in [k for k in os.environ if k.startswith("RELAY_")]:
        monkeypatch.delenv(key)
    for key, value in support.config_data(objs).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RELAY_SECRETS_DIR", str(tmp_path))
    try:
        loaded = settings.load()
    except errors.ConfigError as exc:
        pytest.fail(f"{kustomization}: the settings do not load: {exc}")
    for key, value in string_data.items():
        field = getattr(loaded, key.removeprefix("RELAY_").lower())
        shown = [s.get_secret_value() for s in field] if isinstance(field, list) else None
        assert (shown or [field.get_secret_value()]) == value.split(","), key
    for cidr in filter(None, loaded.allow_networks.split(",")):
        ipaddress.ip_network(cidr.strip())


def test_secret_is_mounted_where_relay_secrets_dir_points() -> None:
    for name, obj in support.all_rendered():
        for _, spec in support.workloads([obj]):
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for container in spec["containers"] + spec.get("initContainers", []):
                where = f"{name}: {support.kind_name(obj)}/{container['name']}"
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                secrets_dir = env.get("RELAY_SECRETS_DIR")
                assert secrets_dir, f"{where}: RELAY_SECRETS_DIR not set"
                mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
                assert secrets_dir in mounts, f"{where}: nothing mounted at {secrets_dir}"
                volume = volumes[mounts[secrets_dir]["name"]]
                assert volume["secret"]["secretName"] == "relay-secrets", where
                assert mounts[secrets_dir].get("readOnly") is True, where
                sources = [e["configMapRef"]["name"] for e in container.get("envFrom", [])]
                assert len(sources) == 1 and support.is_config_name(sources[0]), where


# Which of the Secret's keys each workload sees (its secret volume's ``items``): a key it
# does not read is not in its pod, so a consumer's compromise does not hand over the
# console's operators file (a Secret of its own), and the CronJob holds only its two
# connections.
_CONNECTIONS = {"RELAY_DATABASE_URL", "RELAY_AMQP_URL"}
_SECRETS_BY_COMMAND = {
    "consume": _CONNECTIONS
    | {
        "RELAY_WEBHOOK_SIGNING_SECRETS",
        "RELAY_DESTINATION_SECRETS_KEYS",
        "RELAY_EMAIL_API_KEY",
        "RELAY_SMS_AUTH_TOKEN",
    },
    "publish": _CONNECTIONS,
    "console": _CONNECTIONS,
    "replay": _CONNECTIONS,
    # The providers' secrets that verify their callbacks; RELAY_AMQP_URL only because every
    # relay process's settings need one (relay receipts never connects to the broker).
    "receipts": _CONNECTIONS | {"RELAY_EMAIL_WEBHOOK_SECRETS", "RELAY_SMS_AUTH_TOKEN"},
    # The database only: relay purge never connects to the broker.
    "purge": {"RELAY_DATABASE_URL"},
}


def test_each_workload_mounts_only_the_secret_keys_its_command_reads() -> None:
    seen: set[str] = set()
    for name, obj in support.all_rendered():
        for _, spec in support.workloads([obj]):
            (main,) = spec["containers"]
            command = support.container_argv(main)[0]
            where = f"{name}: {support.kind_name(obj)} ({command})"
            (volume,) = [
                v
                for v in spec.get("volumes", [])
                if v.get("secret", {}).get("secretName") == "relay-secrets"
            ]
            projected = {item["key"] for item in volume["secret"].get("items", [])}
            assert projected == _SECRETS_BY_COMMAND[command], where
            assert all(i["key"] == i["path"] for i in volume["secret"]["items"]), where
            seen.add(command)
    assert seen == set(_SECRETS_BY_COMMAND)
    # Every key of the Secret is read by some workload, and nothing else is projected.
    assert set().union(*_SECRETS_BY_COMMAND.values()) == support.secret_variables()


# --- the consumer's probes, ports and shutdown ------------------------------------------


def _health_routes() -> set[str]:
    async def ready() -> tuple[bool, dict[str, bool]]:
        return True, {}

    def render(_accept: str | None) -> tuple[bytes, str]:
        return b"", "text/plain"

    app = health.build_app(ready, lambda: (True, {}), render)  # only inspected, never served
    return {route.resource.canonical for route in app.router.routes() if route.resource}


def _consumer(objs: tuple[Obj, ...]) -> tuple[Obj, Obj]:
    deployment = support.find(objs, "Deployment", "relay-consumer")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return deployment, container


@pytest.mark.parametrize("kustomization", ["base", "overlays/example"])
def test_probes_match_what_the_consumer_serves(kustomization: str) -> None:
    objs = support.rendered(kustomization)
    deployment, container = _consumer(objs)
    routes = _health_routes()
    port = int(support.config_data(objs).get("RELAY_HEALTH_PORT", Settings().health_port))
    assert port == Settings().health_port == 8081
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probes = {k: container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for kind, probe in probes.items():
        get = probe["httpGet"]
        assert get["path"] in routes, f"{kind}: {get['path']} is not served ({sorted(routes)})"
        assert ports.get(get["port"], get["port"]) == port, f"{kind}: wrong port"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in routes
    assert int(annotations["prometheus.io/port"]) == port
    service = support.find(objs, "Service", "relay-consumer-metrics")
    for service_port in service["spec"]["ports"]:
        assert ports.get(service_port["targetPort"], service_port["targetPort"]) == port
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    pdb = support.find(objs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("kustomization", ["base", "overlays/example"])
def test_termination_grace_exceeds_shutdown_grace(kustomization: str) -> None:
    objs = support.rendered(kustomization)
    grace = float(support.config_data(objs)["RELAY_SHUTDOWN_GRACE_SECONDS"])
    assert grace == Settings().shutdown_grace_seconds or grace > 0
    deployment, _ = _consumer(objs)
    period = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert period >= grace + 10, f"terminationGracePeriodSeconds {period} <= {grace} + 10 s"


# --- publisher CronJob, Jobs ------------------------------------------------------------


def test_publisher_cronjob() -> None:
    cron = support.find(support.rendered("overlays/example"), "CronJob", "relay-publisher")
    spec = cron["spec"]
    assert spec["concurrencyPolicy"] == "Forbid"
    assert croniter.is_valid(spec["schedule"])
    zoneinfo.ZoneInfo(spec["timeZone"])
    # The controller looks every ~10 s; below that a run may never start. Below the
    # schedule's period, a late run is dropped instead of piling onto the next.
    assert 10 <= spec["startingDeadlineSeconds"] < 60
    # Every minute is 1,440 Jobs a day: keep the last few, so Jobs and pods do not pile up.
    assert 1 <= spec["successfulJobsHistoryLimit"] <= 3
    assert 1 <= spec["failedJobsHistoryLimit"] <= 5
    job = spec["jobTemplate"]["spec"]
    assert job["backoffLimit"] <= 2 and job["activeDeadlineSeconds"] > 0
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    args = support.parse_relay_args(support.container_argv(container), "CronJob")
    assert args.command == "publish"


@pytest.mark.parametrize("kustomization", ["base", "overlays/example"])
def test_every_rollout_migrates_first_without_a_job_to_delete(kustomization: str) -> None:
    objs = support.rendered(kustomization)
    assert not [o for o in objs if o["kind"] == "Job"], "no Job whose template blocks a rollout"
    deployment, consumer = _consumer(objs)
    pod = deployment["spec"]["template"]["spec"]
    (migrate,) = pod["initContainers"]
    assert support.container_argv(migrate) == ["migrate"]
    assert migrate["image"] == consumer["image"], "migrate with the version being rolled out"
    assert migrate["envFrom"] == consumer["envFrom"]
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0, "old pods serve while a new pod migrates"


def test_settings_configmap_is_generated_with_a_content_hash() -> None:
    objs = support.rendered("overlays/example")
    config = support.config_map(objs)
    assert config["metadata"]["labels"]["app.kubernetes.io/component"] == "config"
    # Every workload reads the hashed name: an edit renames it and so rolls the pods.
    for obj, spec in support.workloads(objs):
        for container in spec["containers"] + spec.get("initContainers", []):
            (source,) = container["envFrom"]
            assert source["configMapRef"]["name"] == config["metadata"]["name"], obj["kind"]
    # The overlay's values are merged over the base's.
    assert config["data"]["RELAY_MAX_ATTEMPTS_PER_CHANNEL"] == "sms=4,email=10"
    assert config["data"]["RELAY_AMQP_NAMESPACE"] == "relay"
    # A different value gives a different name.
    base = support.config_map(support.rendered("base"))
    assert base["data"] != config["data"] and base["metadata"]["name"] != config["metadata"]["name"]


def test_replay_reads_the_same_settings_as_the_running_consumers() -> None:
    main = support.config_map(support.rendered("overlays/example"))
    replay = support.config_map(support.rendered("overlays/example/replay"))
    assert (replay["metadata"]["name"], replay["data"]) == (main["metadata"]["name"], main["data"])


def test_replay_job_is_a_dry_run_by_default() -> None:
    job = support.find(support.rendered("overlays/example/replay"), "Job", "relay-replay")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = support.parse_relay_args(support.container_argv(container), "replay Job")
    assert args.command == "replay" and args.apply is False
    # The comment shows the acting variant; it must be a valid command too.
    lines = (K8S / "replay" / "replay-job.yaml").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#   args: ["))
    end = next(i for i in range(start, len(lines)) if "]" in lines[i])
    example = " ".join(line.lstrip("#").strip() for line in lines[start : end + 1])
    argv = yaml.safe_load(example.removeprefix("args:"))
    shown = support.parse_relay_args(argv, "replay-job.yaml comment")
    assert shown.command == "replay" and shown.apply is True


def test_no_relay_job_in_the_main_kustomization_acts_without_being_asked() -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in support.rendered("overlays/example")}
    assert ("Job", "relay-replay") not in kinds  # applying the overlay must not replay


# --- network policy -----------------------------------------------------------------------


def _egress_rules() -> list[Obj]:
    policy = support.find(support.rendered("overlays/example"), "NetworkPolicy", "relay-egress")
    assert policy["spec"]["policyTypes"] == ["Egress"]
    selector = policy["spec"]["podSelector"]["matchLabels"].items()
    deployments = [o for o in support.rendered("overlays/example") if o["kind"] == "Deployment"]
    assert deployments
    for deployment in deployments:  # the consumer and the console: every relay pod
        assert selector <= deployment["spec"]["template"]["metadata"]["labels"].items()
    rules: list[Obj] = policy["spec"]["egress"]
    return rules


def _allowed(address: str, port: int, protocol: str = "TCP") -> bool:
    """Whether the egress rules let a relay pod connect to ``address:port``."""
    ip = ipaddress.ip_address(address)
    for rule in _egress_rules():
        ports = rule.get("ports")
        if ports is not None and not any(
            p["port"] == port and p.get("protocol", "TCP") == protocol for p in ports
        ):
            continue
        peers = rule.get("to")
        if peers is None:
            return True
        for peer in peers:
            block = peer["ipBlock"]  # only ipBlock peers: no pod or namespace selectors
            net = ipaddress.ip_network(block["cidr"])
            if ip.version == net.version and ip in net:
                if not any(ip in ipaddress.ip_network(e) for e in block.get("except", [])):
                    return True
    return False


def test_egress_allows_dns_database_broker_and_public_internet() -> None:
    assert _allowed("10.96.0.10", 53, "UDP") and _allowed("10.96.0.10", 53, "TCP")
    assert _allowed("169.254.20.10", 53, "UDP")  # NodeLocal DNSCache
    for port in (5432, 5672, 5671):
        assert _allowed("10.0.12.7", port), port
    for address, port in [("93.184.216.34", 443), ("8.8.8.8", 8443), ("2606:4700::1111", 443)]:
        assert _allowed(address, port), address


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",  # cloud metadata
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "100.64.0.1",
        "127.0.0.1",
        "fd00:ec2::254",  # AWS IMDS over IPv6
        "::ffff:10.0.0.1",
        "fe80::1",
    ],
)
def test_egress_refuses_private_and_metadata_addresses(address: str) -> None:
    assert not _allowed(address, 80) and not _allowed(address, 443)


def test_egress_excludes_every_range_the_ssrf_guard_refuses() -> None:
    """The network policy and service/netpolicy.py agree: whatever the guard refuses, the
    cluster refuses too (the guard unwraps IPv6 forms of IPv4; the policy drops them)."""
    public = [
        ipaddress.ip_network(p["ipBlock"]["cidr"])
        for rule in _egress_rules()
        if rule.get("ports") is None
        for p in rule["to"]
    ]
    excepts = [
        ipaddress.ip_network(e)
        for rule in _egress_rules()
        if rule.get("ports") is None
        for p in rule["to"]
        for e in p["ipBlock"].get("except", [])
    ]
    assert {n.version for n in public} == {4, 6}
    refused = [n for _, nets in netpolicy._V4_RULES + netpolicy._V6_RULES for n in nets]
    for net in refused:
        covered = any(
            net.version == e.version and net.subnet_of(e)  # type: ignore[arg-type]
            for e in excepts
        )
        assert covered, f"{net} is refused by the SSRF guard but not by relay-egress"


# --- pod hardening ----------------------------------------------------------------------


def test_pods_are_hardened() -> None:
    for name, obj in support.all_rendered():
        for _, spec in support.workloads([obj]):
            where = f"{name}: {support.kind_name(obj)}"
            pod_sc = spec["securityContext"]
            assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == support.APP_UID, where
            assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault", where
            assert spec["automountServiceAccountToken"] is False, where
            assert spec["serviceAccountName"] == "relay", where
            tmp_volumes = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
            for container in spec["containers"] + spec.get("initContainers", []):
                sc = container["securityContext"]
                cwhere = f"{where}/{container['name']}"
                assert sc["allowPrivilegeEscalation"] is False, cwhere
                assert sc["readOnlyRootFilesystem"] is True, cwhere
                assert sc["capabilities"]["drop"] == ["ALL"], cwhere
                assert sc.get("privileged", False) is False, cwhere
                assert "add" not in sc["capabilities"], cwhere
                mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
                assert mounts.get("/tmp") in tmp_volumes, f"{cwhere}: /tmp must be an emptyDir"
                resources = container["resources"]
                assert resources["requests"]["memory"] and resources["limits"]["memory"], cwhere
                assert resources["requests"]["cpu"], cwhere


def test_namespace_enforces_restricted_pod_security() -> None:
    namespace = support.find(support.rendered("base"), "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# --- KEDA (custom resources, no schema) -------------------------------------------------


def test_keda_scaledobject_targets_real_objects() -> None:
    objs = support.rendered("overlays/example")
    scaled = support.find(objs, "ScaledObject")
    deployment = support.find(objs, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    assert "replicas" not in deployment["spec"], "KEDA's HPA owns the replica count"
    assert scaled["spec"]["minReplicaCount"] >= 2
    assert scaled["spec"]["maxReplicaCount"] >= scaled["spec"]["minReplicaCount"]
    namespace = support.config_data(objs)["RELAY_AMQP_NAMESPACE"]
    queues = set(
        amqp.Topology(
            namespace=namespace, delay_tiers_seconds=(1.0,), delivery_limit=1
        ).all_queues()
    )
    secret = support.find(objs, "Secret", "relay-secrets")
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "rabbitmq"
        assert trigger["metadata"]["queueName"] in queues
        int(trigger["metadata"]["value"])
        auth = support.find(objs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["name"] == "relay-secrets" and ref["key"] in secret["stringData"]


# --- the operator console ---------------------------------------------------------------


def _console_routes() -> set[str]:
    from service.clock import SystemClock
    from service.destination_switch import MissedFire
    from service.ops.console import actions as console_actions
    from service.ops.console import app as console_app
    from service.ops.console import refs, security, sessions, throttle

    async def no_replay(*_: object) -> object:
        raise AssertionError("only inspected, never served")

    policy = sessions.Policy()
    door = security.Door(
        None,  # type: ignore[arg-type]
        sessions.Sessions(None, SystemClock(), policy),  # type: ignore[arg-type]
        throttle.LoginThrottle(),
        telemetry.noop().console_login_failures,
    )
    switching = console_actions.Switching((), MissedFire(300.0, 24), SystemClock())
    key = refs.RefKey(bytes(32))
    built = console_app.build(None, no_replay, no_replay, door, switching, key)  # type: ignore[arg-type]
    return {route.resource.canonical for route in built.router.routes() if route.resource}


@pytest.mark.parametrize("kustomization", ["base", "overlays/example"])
def test_the_console_is_reached_by_port_forward_only_through_its_service(
    kustomization: str,
) -> None:
    objs = support.rendered(kustomization)
    deployment = support.find(objs, "Deployment", "relay-console")
    spec = deployment["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert support.container_argv(container)[-1] == "console"
    assert deployment["spec"]["replicas"] == 1
    env = {e["name"]: e.get("value") for e in container["env"]}
    port = int(env["RELAY_CONSOLE_PORT"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert list(ports.values()) == [port]
    routes = _console_routes()
    for kind in ("readinessProbe", "livenessProbe"):
        get = container[kind]["httpGet"]
        assert get["path"] in routes and ports[get["port"]] == port, kind
    service = support.find(objs, "Service", "relay-console")
    assert service["spec"]["type"] == "ClusterIP"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    targets = [ports.get(p["targetPort"], p["targetPort"]) for p in service["spec"]["ports"]]
    assert targets == [port]
    policy = support.find(objs, "NetworkPolicy", "relay-ingress")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])}
    assert port not in admitted, "the console's port must not be open to the cluster"
    # The operators file is a Secret of its own, mounted as a directory (no subPath), so an
    # edit (a revoked operator) reaches the running console.
    operators = Path(env["RELAY_CONSOLE_OPERATORS_FILE"])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[str(operators.parent)]
    assert "subPath" not in mount and mount.get("readOnly") is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "relay-console-operators"
    assert volume["secret"]["items"] == [{"key": "operators", "path": operators.name}]
    assert env["RELAY_CONSOLE_HTTPS"] == "true"  # __Host- and Secure: loopback or TLS
