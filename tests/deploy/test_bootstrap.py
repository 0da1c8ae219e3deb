"""scripts/bootstrap on a machine with Python 3.11 alone, after a run that failed half-way.

Each test runs the real script in a subprocess with a PATH holding one interpreter, a
``python3.11``, and the few tools the scripts use, in a scratch copy of the repository
whose project has no dependencies (bootstrap's own work is what is tested: making the
virtualenv, installing, ``scripts/services up``; not pip resolving this project). The
machine's shared PostgreSQL and RabbitMQ are running, so ``scripts/services up`` reuses
them and touches nothing. Debian without python3.11-venv is stood in for by an
``ensurepip`` that cannot be imported, first on PYTHONPATH (this PATH has no apt-get, so
bootstrap can only name the package).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.support import REPO, only_python_311_path

PROBE_PROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "bootstrap-probe"
version = "0"
requires-python = ">=3.11"

[project.optional-dependencies]
test = []

[tool.setuptools]
py-modules = []
"""


def _scratch_repo(root: Path) -> Path:
    """A copy of the repository's scripts beside a project with nothing to install."""
    (root / "scripts").mkdir(parents=True)
    for name in ("bootstrap", "services"):
        shutil.copy2(REPO / "scripts" / name, root / "scripts" / name)
    (root / "pyproject.toml").write_text(PROBE_PROJECT)
    return root


def _bootstrap(
    scratch: Path, tmp_path: Path, *, ensurepip: bool = True
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    environ.update(
        PATH=str(only_python_311_path(tmp_path / "bin")),
        PYENV_ROOT=str(tmp_path / "no-pyenv"),
        RELAY_SERVICES_DIR=str(tmp_path / "services"),
    )
    if not ensurepip:
        shadow = tmp_path / "no-ensurepip" / "ensurepip"
        shadow.mkdir(parents=True, exist_ok=True)
        (shadow / "__init__.py").write_text("raise ImportError('python3.11-venv is missing')\n")
        environ["PYTHONPATH"] = str(shadow.parent)
    return subprocess.run(
        [str(scratch / "scripts" / "bootstrap")],
        cwd=scratch,
        env=environ,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )


def _venv_without_pip(scratch: Path, tmp_path: Path) -> Path:
    """What ``python3.11 -m venv`` leaves on Debian without python3.11-venv: the tree and
    its python, no pip (it fails at ensurepip)."""
    venv = scratch / ".venv"
    python = only_python_311_path(tmp_path / "bin") / "python3.11"
    subprocess.run([str(python), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return venv


def _venv_python_version(venv: Path) -> str:
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def _assert_ready(venv: Path, result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert _venv_python_version(venv) == "(3, 11)"
    assert list(venv.glob(".installed-*")) and not (venv / ".installing").exists()
    assert "reusing it" in result.stdout  # scripts/services up found the shared servers


NO_VENV_MODULE = (
    "bootstrap: python3.11 cannot make a virtualenv (no ensurepip): install Debian's"
    " python3.11-venv (as root: apt-get install python3.11-venv)"
)


@pytest.mark.timeout(600)
def test_a_venv_whose_python_is_empty_is_made_again_and_then_kept(tmp_path: Path) -> None:
    scratch = _scratch_repo(tmp_path / "repo")
    venv = _venv_without_pip(scratch, tmp_path)
    python = venv / "bin" / "python"
    python.unlink()
    python.write_text("")  # an interrupted copy
    python.chmod(0o755)

    repaired = _bootstrap(scratch, tmp_path)
    assert ".venv is half-made (bin/python does not run); making it again" in repaired.stderr
    _assert_ready(venv, repaired)

    (venv / "kept").touch()  # a sound virtualenv is kept as it is
    again = _bootstrap(scratch, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "half-made" not in again.stderr and (venv / "kept").exists()


@pytest.mark.timeout(600)
def test_after_a_run_without_python3_venv_the_package_is_named_then_the_venv_repaired(
    tmp_path: Path,
) -> None:
    scratch = _scratch_repo(tmp_path / "repo")
    venv = _venv_without_pip(scratch, tmp_path)

    refused = _bootstrap(scratch, tmp_path, ensurepip=False)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines() == [
        "bootstrap: .venv is half-made (no pip in it); making it again",
        NO_VENV_MODULE,
    ]
    assert not venv.exists()

    _venv_without_pip(scratch, tmp_path)  # as the failed run left it, once more
    repaired = _bootstrap(scratch, tmp_path)  # python3.11-venv installed meanwhile
    assert ".venv is half-made (no pip in it); making it again" in repaired.stderr
    _assert_ready(venv, repaired)


def test_a_venv_whose_install_did_not_finish_is_not_trusted(tmp_path: Path) -> None:
    scratch = _scratch_repo(tmp_path / "repo")
    venv = _venv_without_pip(scratch, tmp_path)
    (venv / ".installing").touch()  # what an install cut short leaves, with no stamp
    result = _bootstrap(scratch, tmp_path, ensurepip=False)  # stops before making it again
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "bootstrap: .venv is half-made (an earlier install did not finish); making it again",
        NO_VENV_MODULE,
    ]


def test_a_fresh_machine_without_python3_venv_is_told_the_package(tmp_path: Path) -> None:
    scratch = _scratch_repo(tmp_path / "repo")
    result = _bootstrap(scratch, tmp_path, ensurepip=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [NO_VENV_MODULE]
    assert not (scratch / ".venv").exists()


def test_a_directory_that_is_not_a_venv_is_never_removed(tmp_path: Path) -> None:
    scratch = _scratch_repo(tmp_path / "repo")
    (scratch / ".venv").mkdir()
    (scratch / ".venv" / "notes.txt").write_text("mine")
    result = _bootstrap(scratch, tmp_path)
    assert result.returncode == 2, result.stderr
    assert "is not a usable virtualenv (no bin/python) nor one at all" in result.stderr
    assert (scratch / ".venv" / "notes.txt").read_text() == "mine"
