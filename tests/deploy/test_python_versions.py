"""Python 3.11 to 3.13: the package admits every supported version, and the test command
(the one CI runs) runs the unit tests on the newer ones too."""

from __future__ import annotations

import re
import subprocess
import tomllib

from tests.deploy.support import REPO

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


def test_a_missing_interpreter_fails_the_run_naming_how_to_install_it() -> None:
    result = subprocess.run(
        [str(REPO / "scripts" / "test"), "--python", "3.19", "tests/unit"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "Python 3.19 is not installed" in result.stderr and "pyenv install" in result.stderr
