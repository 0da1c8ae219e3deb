"""The Dockerfile's build stage, replayed in a fresh virtualenv (no Docker needed).

The build context is assembled from the stage's COPY instructions, filtered through
.dockerignore; each RUN command then runs with the image paths (/opt/relay, /build) mapped
into tmp_path. The deliberate differences: pip may use its local cache (the Dockerfile
passes --no-cache-dir to keep the layer small), and does not byte-compile what it installs
(a quarter of the test's CPU; nothing checked here depends on .pyc files). Needs PyPI or
pip's cache: about half a minute.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy import support
from tests.deploy.support import REPO


def _build_stage() -> list[tuple[str, str]]:
    name, stage = support.dockerfile_stages()[0]
    assert name == "build", f"the first stage should be the build stage, not {name!r}"
    return stage


def _assemble_context(stage: list[tuple[str, str]], root: Path) -> None:
    """Copy what each COPY takes from the context (after .dockerignore) to its image path."""
    for sources, destination in support.copy_sources(stage):
        dest = root / destination.lstrip("/")
        for source in sources:
            src = REPO / source
            for file in support.context_files(source):
                if src.is_dir():  # a directory's contents go into the destination
                    out = dest / file.relative_to(src)
                elif destination.endswith("/"):
                    out = dest / src.name
                else:
                    out = dest
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(file, out)


def _commands(stage: list[tuple[str, str]], root: Path) -> list[list[str]]:
    """The RUN steps as argument lists, image paths mapped under root."""
    commands = []
    for keyword, rest in stage:
        if keyword != "RUN":
            continue
        assert not rest.startswith("["), "exec-form RUN is not replayed"
        for step in rest.split("&&"):
            words = shlex.split(step)
            if words[-2:] == [">", "/dev/null"]:
                words = words[:-2]
            assert not {"|", ">", "<", ";"} & set(words), f"unsupported shell syntax: {step}"
            words = [w for w in words if w != "--no-cache-dir"]
            mapped = [w.replace("/opt/relay", str(root / "opt/relay")) for w in words]
            mapped = [w.replace("/build", str(root / "build")) for w in mapped]
            if mapped[0] == "python":
                mapped[0] = sys.executable  # the base image's interpreter: Python 3.11
            commands.append(mapped)
    return commands


@pytest.mark.image_install
# Hang guards: 105 s alone on a slow VM, past 300 s with two suites at once there.
@pytest.mark.timeout(900)
def test_dockerfile_install_steps_give_a_working_relay(tmp_path: Path) -> None:
    assert sys.version_info[:2] == (3, 11), "the image runs Python 3.11"
    stage = _build_stage()
    _assemble_context(stage, tmp_path)
    assert (tmp_path / "build/src/pyproject.toml").exists()
    assert not list((tmp_path / "build/src").rglob("__pycache__")), ".dockerignore lets caches in"

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "VIRTUAL_ENV"))}
    env["PIP_NO_COMPILE"] = "1"
    for keyword, rest in stage:
        if keyword == "ENV":
            for assignment in shlex.split(rest):
                key, _, value = assignment.partition("=")
                env[key] = value
    for command in _commands(stage, tmp_path):
        result = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        assert result.returncode == 0, (
            f"{shlex.join(command)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
            f"{result.stderr[-3000:]}"
        )

    venv = tmp_path / "opt/relay"
    relay = venv / "bin/relay"
    for argv in (["--help"], ["consume", "--help"], ["publish", "--help"], ["replay", "--help"]):
        result = subprocess.run(
            [str(relay), *argv], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, result.stderr
        assert "usage: relay" in result.stdout
    # A configuration error is reported by the installed code itself, as exit 2.
    bad = subprocess.run(
        [str(relay), "status"],
        env={**env, "RELAY_PREFETCH": "0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and "RELAY_PREFETCH" in bad.stderr, bad.stderr
    site = venv / "lib/python3.11/site-packages"
    console = site / "service/ops/console"  # package data: the console's pages
    assert (console / "templates/runs.html").is_file()
    assert (console / "static/console.css").is_file()
    assert not list(site.glob("pip")) and not list(site.glob("setuptools")), "pip left in image"
    size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink())
    print(f"\n/opt/relay in the image: {size / 2**20:.1f} MiB")
