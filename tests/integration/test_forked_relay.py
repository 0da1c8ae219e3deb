"""The tests' fork server (tests.support.forked) gives what a fresh ``relay`` process gives:
its own pid, exit code, stdin, stdout and stderr, environment, and death by a signal."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from service.settings import Settings
from tests.support import forked
from tests.support import relay as rs

pytestmark = pytest.mark.timeout(120)


async def test_a_forked_relay_has_its_own_output_exit_code_and_environment(
    settings: Settings,
) -> None:
    version = await forked.spawn(["--version"], rs.env_for(settings), stdout=forked.PIPE)
    out, _ = await version.communicate()
    assert version.returncode == 0 and out.decode().startswith("relay ")
    assert version.pid != os.getpid()

    # A setting only the child's environment has: the child reads it, this process never.
    bad = await rs.relay(settings, "status", PREFETCH="lots")
    assert bad.code == 2
    assert "RELAY_PREFETCH" in bad.stderr and "RELAY_PREFETCH" not in os.environ

    # stdin reaches the child: a bad line is named by its number.
    loaded = await rs.relay(settings, "reminders", "load", "-", stdin="not json\n")
    assert loaded.code == 2 and "line 1" in loaded.stderr


async def test_a_forked_consumer_dies_by_sigkill_and_ends_by_sigterm(
    settings: Settings, tmp_path: Path
) -> None:
    killed = await rs.start_consumer(settings, tmp_path / "killed.log")
    await rs.wait_for(lambda: rs.logged(tmp_path / "killed.log", "consume_started"), 60, "start")
    assert killed.returncode is None
    os.kill(killed.pid, signal.SIGKILL)
    assert await asyncio.wait_for(killed.wait(), 30) == -signal.SIGKILL
    assert killed.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        killed.send_signal(signal.SIGTERM)

    stopped = await rs.start_consumer(settings, tmp_path / "stopped.log")
    await rs.wait_for(lambda: rs.logged(tmp_path / "stopped.log", "consume_started"), 60, "start")
    assert await rs.stop(stopped) == 0
