"""Checks of the deployment files (deploy/, docker-compose.yml, .dockerignore).

Everything here runs offline and in well under a second per test, except the test marked
``image_install`` (tests/deploy/test_image_install.py), which replays the Dockerfile's
install steps in a fresh virtualenv (about a minute; needs PyPI or pip's cache), and the
two tests of tests/deploy/test_bootstrap.py that let scripts/bootstrap make a virtualenv
(about 20 s each; pip's cache or PyPI). Select or skip the first with ``-m image_install``
/ ``-m "not image_install"``.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "image_install: replays deploy/Dockerfile's install steps in a fresh virtualenv (~1 min)",
    )
