"""Python 3.11 to 3.13: the package admits every supported version, and the test command
(the one CI runs) runs the unit tests on the newer ones too: those installed, unless
TEST_EXTRA_PYTHONS asks for them (then a missing one fails the run)."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

from tests.deploy.support import REPO, only_python_311_path

SUPPORTED = ("3.11", "3.12", "3.13")


def test_requires_python_has_a_floor_and_no_ceiling() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["requires-python"] == ">=3.11"
    classifiers = {c.rsplit(" :: ", 1)[-1] for c in project["classifiers"] if "Python :: 3." in c}
    assert classifiers == set(SUPPORTED)


def test_ci_runs_the_readme_test_command_which_covers_every_version() -> None:
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^exec scripts/test$", ci, re.MULTILINE)
    script = (REPO / "scripts" / "test").read_text(encoding="utf-8")
    (default,) = re.findall(r"TEST_EXTRA_PYTHONS-([^}]*)}", script)
    assert default.split() == list(SUPPORTED[1:])
    assert 'scripts/test --python "$version" tests/unit' in script


def test_an_interpreter_asked_for_by_name_but_missing_fails_naming_how_to_install_it() -> None:
    result = subprocess.run(
        [str(REPO / "scripts" / "test"), "--python", "3.19", "tests/unit"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "Python 3.19 is not installed" in result.stderr and "pyenv install" in result.stderr


def _check_pythons(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``scripts/test --check-pythons`` on a PATH with Python 3.11 alone, pyenv's versions
    hidden (PYENV_ROOT at an empty directory)."""
    environ = {k: v for k, v in os.environ.items() if k != "TEST_EXTRA_PYTHONS"}
    environ.update(
        PATH=str(only_python_311_path(tmp_path / "bin")),
        PYENV_ROOT=str(tmp_path / "no-pyenv"),
        **env,
    )
    return subprocess.run(
        [str(REPO / "scripts" / "test"), "--check-pythons"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_with_python_311_alone_each_missing_newer_version_is_one_line_not_a_failure(
    tmp_path: Path,
) -> None:
    result = _check_pythons(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""  # no newer version to run
    assert result.stderr.splitlines() == [
        f"test: Python {v} is not installed, so its unit tests are skipped"
        f" (install it to run them, e.g. `pyenv install {v}`)"
        for v in SUPPORTED[1:]
    ]


def test_a_version_test_extra_pythons_names_is_required(tmp_path: Path) -> None:
    result = _check_pythons(tmp_path, TEST_EXTRA_PYTHONS="3.13")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "test: Python 3.13 is not installed, and TEST_EXTRA_PYTHONS asks for it:"
        " install it (e.g. `pyenv install 3.13`) or leave it out"
    ]


def test_a_version_found_on_path_is_run(tmp_path: Path) -> None:
    result = _check_pythons(tmp_path, TEST_EXTRA_PYTHONS="3.11")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"test: Python 3.11: {tmp_path / 'bin' / 'python3.11'}"]
    assert result.stderr == ""
