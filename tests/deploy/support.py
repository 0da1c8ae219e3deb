"""Helpers shared by the deployment checks: paths, YAML, kustomize, Dockerfile parsing."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.ops.cli import build_parser
from service.settings import Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
COMPOSE = REPO / "docker-compose.yml"
CONSTRAINTS = DEPLOY / "constraints.txt"
ALERTS = DEPLOY / "observability" / "alerts.yaml"
# promtool unit tests of alerts.yaml: most evaluated every minute, those spanning days
# every 10 minutes (each file has one evaluation interval).
ALERT_TESTS = (
    DEPLOY / "observability" / "alerts.test.yaml",
    DEPLOY / "observability" / "alerts.days.test.yaml",
)

# Every kustomization that must build; the first three are what an operator applies.
KUSTOMIZATIONS = ["base", "overlays/example", "overlays/example/replay", "replay"]

# Read outside Settings (service/ops/cli.py, service/settings.py).
EXTRA_VARIABLES = {"RELAY_SECRETS_DIR", "RELAY_LOG_LEVEL"}

IMAGE_NAME = "reminder-relay"  # the name every manifest uses; kustomize `images` rewrites it
APP_UID = 10001


Obj = dict[str, Any]


def setting_variables() -> set[str]:
    """Every RELAY_* variable the processes read."""
    return {f"RELAY_{name.upper()}" for name in Settings.model_fields} | EXTRA_VARIABLES


def secret_variables() -> set[str]:
    """Variables whose setting is a SecretStr (or a list of them): these belong in a Secret."""
    return {
        f"RELAY_{name.upper()}"
        for name, field in Settings.model_fields.items()
        if "SecretStr" in str(field.annotation)
    }


def load_docs(path: Path) -> list[Obj]:
    """All non-empty YAML documents of a file."""
    with path.open(encoding="utf-8") as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc is not None]


@cache
def alert_rules() -> tuple[Obj, ...]:
    """Every rule of deploy/observability/alerts.yaml, across its groups."""
    doc = load_docs(ALERTS)
    assert len(doc) == 1, "alerts.yaml: one YAML document with `groups`"
    return tuple(rule for group in doc[0]["groups"] for rule in group["rules"])


@cache
def alert_test_cases() -> tuple[Obj, ...]:
    """The promtool unit test cases of every file in ``ALERT_TESTS``."""
    return tuple(case for path in ALERT_TESTS for case in load_docs(path)[0]["tests"])


def parse_relay_args(argv: list[str], where: str) -> Any:
    """Parse ``relay`` arguments exactly as the console script does; fail with context."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `relay {shlex.join(argv)}` is not a valid command (exit {exc})")


def relay_invocations(shell: str) -> list[list[str]]:
    """The ``relay ...`` commands inside a shell snippet (up to ; & | or a redirection)."""
    found = []
    for match in re.finditer(r"(?:^|[;&|(]|\bdo|\bthen)\s*relay\s+([^;&|<>()]*)", shell):
        found.append(shlex.split(match.group(1)))
    return found


# --- kustomize ------------------------------------------------------------------------


def kustomize_command() -> list[str]:
    """`kustomize build` or `kubectl kustomize` (kubectl ships in this machine's image)."""
    if exe := shutil.which("kustomize"):
        return [exe, "build"]
    if exe := shutil.which("kubectl"):
        return [exe, "kustomize"]
    # Not installable from the registries this project may use; the project's machines
    # ship kubectl. Elsewhere this shows as a skip (never a pass), and the pure-Python
    # structural check in test_k8s.py still runs.
    pytest.skip(
        "neither kustomize nor kubectl is on PATH: install kubectl (Kubernetes apt "
        "repository) to run the kustomize build checks"
    )


@cache
def rendered(kustomization: str) -> tuple[Obj, ...]:
    """The objects a kustomization renders to (cached per test session)."""
    result = subprocess.run(
        [*kustomize_command(), str(K8S / kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"kustomize build {kustomization} failed:\n{result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def all_rendered() -> Iterator[tuple[str, Obj]]:
    for name in KUSTOMIZATIONS:
        for obj in rendered(name):
            yield name, obj


def kind_name(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def pod_spec(obj: Obj) -> Obj | None:
    """The pod spec of a workload object, or None for anything else."""
    if obj["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
        spec: Obj = obj["spec"]["template"]["spec"]
        return spec
    if obj["kind"] == "CronJob":
        spec = obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        return spec
    return None


def workloads(objs: tuple[Obj, ...] | list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for obj in objs:
        spec = pod_spec(obj)
        if spec is not None:
            yield obj, spec


def find(objs: tuple[Obj, ...] | list[Obj], kind: str, name: str | None = None) -> Obj:
    matches = [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


# The settings ConfigMap's name before kustomize appends its content hash.
CONFIG_NAME = "relay-config"


def is_config_name(name: str) -> bool:
    """Whether ``name`` is the generated settings ConfigMap (``relay-config-<hash>``)."""
    return re.fullmatch(rf"{CONFIG_NAME}-[a-z0-9]{{10}}", name) is not None


def config_map(objs: tuple[Obj, ...] | list[Obj]) -> Obj:
    matches = [
        o for o in objs if o["kind"] == "ConfigMap" and is_config_name(o["metadata"]["name"])
    ]
    assert len(matches) == 1, f"expected one ConfigMap {CONFIG_NAME}-<hash>, found {len(matches)}"
    return matches[0]


def config_data(objs: tuple[Obj, ...] | list[Obj]) -> dict[str, str]:
    data: dict[str, str] = config_map(objs)["data"]
    return data


def container_argv(container: Obj) -> list[str]:
    """The ``relay`` arguments a container runs (the image's ENTRYPOINT is ``relay``)."""
    command = container.get("command")
    args = [str(a) for a in container.get("args", [])]
    if command:
        assert command[0] == "relay", f"{container['name']}: command must start with relay"
        return [*map(str, command[1:]), *args]
    return args or ["consume"]  # the image's default CMD


# --- Dockerfile -----------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines: list[tuple[str, str]] = []
    buffer = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        stripped = raw.strip()
        if not buffer and (not stripped or stripped.startswith("#")):
            continue
        if buffer and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        buffer += stripped
        keyword, _, rest = buffer.partition(" ")
        lines.append((keyword.upper(), rest.strip()))
        buffer = ""
    assert not buffer, "Dockerfile ends inside a continued instruction"
    return lines


def dockerfile_stages() -> list[tuple[str, list[tuple[str, str]]]]:
    """(stage name, its instructions) for every FROM."""
    stages: list[tuple[str, list[tuple[str, str]]]] = []
    for keyword, rest in dockerfile_instructions():
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else str(len(stages))
            stages.append((name, []))
        elif stages:
            stages[-1][1].append((keyword, rest))
    return stages


def json_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list), f"expected exec (JSON) form, got {rest!r}"
    return [str(v) for v in value]


def copy_sources(stage: list[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context in a stage."""
    copies = []
    for keyword, rest in stage:
        if keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(rest)
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        copies.append((words[:-1], words[-1]))
    return copies


# --- .dockerignore --------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out += pattern[i : end + 1]
            i = end + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


@cache
def _dockerignore_rules() -> tuple[tuple[bool, re.Pattern[str]], ...]:
    rules = []
    for raw in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line[1:] if negated else line
        pattern = pattern.strip().lstrip("/").removeprefix("./").rstrip("/")
        rules.append((negated, _pattern_regex(pattern)))
    return tuple(rules)


def excluded_from_context(relative: str) -> bool:
    """Docker's rule: the last pattern matching the path or any parent directory wins."""
    parts = relative.strip("/").split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for negated, regex in _dockerignore_rules():
        if any(regex.match(c) for c in candidates):
            excluded = not negated
    return excluded


def context_files(source: str) -> list[Path]:
    """The files under a COPY source that reach the build context."""
    root = REPO / source
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return [p for p in files if not excluded_from_context(p.relative_to(REPO).as_posix())]


def venv_bin(name: str) -> Path | None:
    """A console script of this interpreter's environment, else one on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return candidate
    found = shutil.which(name)
    return Path(found) if found else None


# --- a machine with Python 3.11 alone ---------------------------------------------------

# What scripts/bootstrap, scripts/services (up) and scripts/test (--check-pythons) run,
# besides bash's builtins.
SCRIPT_TOOLS = (
    "bash", "env", "dirname", "sha256sum", "cut", "rm", "touch", "mkdir", "cat", "sed",
    "grep", "timeout", "date", "head", "tail", "awk", "realpath", "ls", "sort", "id",
    "readlink", "stat",
)  # fmt: skip


def only_python_311_path(bin_dir: Path) -> Path:
    """A directory for PATH with one interpreter, ``python3.11`` (the one this test
    session's virtualenv was made from), and the tools the scripts use: no python3,
    python3.12, python3.13, pyenv or apt-get."""
    python = Path(sys.base_prefix) / "bin" / "python3.11"
    assert python.exists(), f"no Python 3.11 at {python}"
    if (bin_dir / "python3.11").exists():
        return bin_dir  # made by an earlier call
    bin_dir.mkdir(parents=True)
    (bin_dir / "python3.11").symlink_to(python)
    for tool in SCRIPT_TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is not on this machine's PATH"
        (bin_dir / tool).symlink_to(found)
    return bin_dir
