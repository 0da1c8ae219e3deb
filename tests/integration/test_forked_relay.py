"""The tests' fork server (tests.support.forked) gives what a fresh ``relay`` process gives:
its own pid, exit code, stdin, stdout and stderr, environment, and death by a signal."""

from __future__ import annotations

import asyncio
import gc
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


def _children_of_the_fork_server() -> set[int]:
    assert forked._server is not None
    pid = forked._server._proc.pid
    return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


async def test_a_spawn_cancelled_at_any_step_leaves_no_process_and_no_open_stream(
    settings: Settings,
) -> None:
    """A publish loop is cancelled wherever it is, once inside ``spawn``: the process it
    was starting must not run on unheld, nor its status stream wait for a later test's
    garbage collection to be closed (an "unclosed StreamWriter" failed that test)."""
    await (await forked.spawn(["--version"], rs.env_for(settings))).wait()  # server up
    before = _children_of_the_fork_server()
    cancelled_inside = 0
    for steps in range(12):  # a cancel after 0, 1, 2, ... turns of the event loop
        task = asyncio.create_task(
            forked.spawn(
                ["consume"],
                rs.env_for(settings),
                stdin=forked.PIPE,
                stdout=forked.PIPE,
                stderr=forked.PIPE,
            )
        )
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        try:
            proc = await task
        except asyncio.CancelledError:
            cancelled_inside += 1
            continue
        proc.kill()
        await proc.wait()
        assert proc.stdin is not None
        proc.stdin.close()
    assert cancelled_inside >= 3, "no cancel landed inside spawn: the test proves nothing"

    async def none_left() -> bool:
        return _children_of_the_fork_server() <= before

    await rs.wait_for(none_left, 30, "the cancelled spawns' processes gone")
    gc.collect()  # an unclosed stream warns here, and the suite turns that into a failure
