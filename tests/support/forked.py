"""Start ``relay`` processes for tests: forked from a pre-imported server (tests.support.zygote),
or, with ``TEST_RELAY_FRESH_PROCESSES=1``, as fresh interpreters (``python -m service.ops.cli``).

Either way the test gets a real process (its own pid, exit code, stdin, stdout and stderr)
through the part of ``asyncio.subprocess.Process`` the tests use. The fork server saves
the ~1 CPU-second each fresh interpreter spends importing before it does anything; the
fresh path is there to check that nothing depends on the fork (and the demo and the
image tests always start fresh interpreters).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Protocol

from tests.support.zygote import request_bytes

REPO = Path(__file__).resolve().parents[2]
PIPE = asyncio.subprocess.PIPE
DEVNULL = asyncio.subprocess.DEVNULL
_FRESH = os.environ.get("TEST_RELAY_FRESH_PROCESSES") == "1"


def relay_command(*args: str) -> list[str]:
    """argv of ``relay ARGS`` run from this checkout with this interpreter."""
    return [sys.executable, "-m", "service.ops.cli", *args]


class RelayProcess(Protocol):
    """What tests use of a process: ``asyncio.subprocess.Process`` or a ``ForkedProcess``."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def stdin(self) -> asyncio.StreamWriter | None: ...
    @property
    def stdout(self) -> asyncio.StreamReader | None: ...
    @property
    def stderr(self) -> asyncio.StreamReader | None: ...
    async def wait(self) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    async def communicate(self, input: bytes | None = None) -> tuple[bytes, bytes]: ...


class ForkedProcess:
    """A child of the fork server, as far as tests use ``asyncio.subprocess.Process``."""

    def __init__(
        self,
        pid: int,
        status: asyncio.StreamReader,
        status_writer: asyncio.StreamWriter,
        stdin: asyncio.StreamWriter | None,
        stdout: asyncio.StreamReader | None,
        stderr: asyncio.StreamReader | None,
    ) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._status_writer = status_writer
        # Set as soon as the child exits, like asyncio's child watcher does.
        self._exited = asyncio.create_task(self._read_status(status))

    async def _read_status(self, status: asyncio.StreamReader) -> int:
        line = await status.readline()
        self._status_writer.close()
        if not line:
            raise RuntimeError(f"fork server went away before relay process {self.pid} ended")
        self.returncode = int(line)
        return self.returncode

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    async def communicate(self, input: bytes | None = None) -> tuple[bytes, bytes]:
        async def feed() -> None:
            if self.stdin is None:
                return
            if input:
                self.stdin.write(input)
                try:
                    await self.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass
            self.stdin.close()

        async def read(stream: asyncio.StreamReader | None) -> bytes:
            return b"" if stream is None else await stream.read()

        _, out, err = await asyncio.gather(feed(), read(self.stdout), read(self.stderr))
        await self.wait()
        return out, err


class _Server:
    """This worker's fork server, started at first use, stopped when the worker exits."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="relay-zygote-")
        self.path = os.path.join(self._dir, "socket")
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        env["PYTHONPATH"] = str(REPO)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
            env=env,
        )
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], 120)
        line = self._proc.stdout.readline() if ready else b""
        if line != b"ready\n":
            self._proc.kill()
            raise RuntimeError(f"the tests' fork server did not start: {line!r}")
        atexit.register(self.close)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()  # the server exits; children it forked live on
        self._proc.wait(30)
        if self._proc.stdout is not None:
            self._proc.stdout.close()  # else "unclosed file" at every worker's exit
        shutil.rmtree(self._dir, ignore_errors=True)


_server: _Server | None = None


def _fd_for(spec: int | IO[Any] | None, target: int, ours: list[int], theirs: list[int]) -> None:
    """The child's end of its stdio stream ``target`` (0, 1, 2) into ``theirs``; a pipe's
    other end into ``ours``."""
    if spec == PIPE:
        read, write = os.pipe()
        child, parent = (read, write) if target == 0 else (write, read)
        ours.append(parent)
        theirs.append(child)
    elif spec == DEVNULL:
        ours.append(-1)
        theirs.append(os.open(os.devnull, os.O_RDWR))
    elif spec is None:  # inherited, as asyncio does: this process's own stream
        ours.append(-1)
        theirs.append(os.dup(target))
    elif isinstance(spec, int):
        ours.append(-1)
        theirs.append(os.dup(spec))
    else:
        ours.append(-1)
        theirs.append(os.dup(spec.fileno()))


async def _reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader


async def _writer(fd: int) -> asyncio.StreamWriter:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(fd, "wb", buffering=0)
    )
    return asyncio.StreamWriter(transport, protocol, None, loop)


async def spawn(
    args: list[str],
    env: dict[str, str],
    *,
    stdin: int | IO[Any] | None = DEVNULL,
    stdout: int | IO[Any] | None = DEVNULL,
    stderr: int | IO[Any] | None = DEVNULL,
) -> RelayProcess:
    """Start ``relay ARGS`` with ``env`` in the repository's folder (``stdin`` etc. as for
    ``asyncio.create_subprocess_exec``); returns a process object."""
    if _FRESH:
        return await asyncio.create_subprocess_exec(
            *relay_command(*args),
            env=env, stdin=stdin, stdout=stdout, stderr=stderr, cwd=REPO,
        )  # fmt: skip
    global _server
    if _server is None:
        _server = _Server()
    ours: list[int] = []
    theirs: list[int] = []
    for target, spec in enumerate((stdin, stdout, stderr)):
        _fd_for(spec, target, ours, theirs)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(_server.path)
        socket.send_fds(conn, [request_bytes(args, env, str(REPO))], theirs)
    except BaseException:
        conn.close()
        for fd in ours:
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    # Once the request is sent the server forks: from here a cancel (a test stopping its
    # publish loop) must not leave that process running unheld, nor its streams to a later
    # test's garbage collection ("unclosed StreamWriter", which the suite turns into an
    # error there). So the start runs to its end, and a cancelled caller ends the process.
    started = asyncio.ensure_future(_started(conn, ours))
    try:
        return await asyncio.shield(started)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            proc = await asyncio.wait_for(started, 30)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            if proc.stdin is not None:
                proc.stdin.close()
            await asyncio.wait_for(proc.wait(), 30)
        raise


async def _started(conn: socket.socket, ours: list[int]) -> ForkedProcess:
    """The process the server forked for the request just sent on ``conn``, with this
    end of its pipes (``ours``); on any failure nothing of it is left open or running."""
    conn.setblocking(False)
    status_writer: asyncio.StreamWriter | None = None
    stdin_writer: asyncio.StreamWriter | None = None
    pid: int | None = None
    try:
        status, status_writer = await asyncio.open_unix_connection(sock=conn)
        line = await status.readline()
        if not line:
            raise RuntimeError("the tests' fork server refused a relay process (see its stderr)")
        pid = int(line)
        stdin_writer = await _writer(_take(ours, 0)) if ours[0] >= 0 else None
        stdout_reader = await _reader(_take(ours, 1)) if ours[1] >= 0 else None
        stderr_reader = await _reader(_take(ours, 2)) if ours[2] >= 0 else None
    except BaseException:
        for writer in (status_writer, stdin_writer):
            if writer is not None:
                writer.close()
        conn.close()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)  # its stdout and stderr pipes then close at EOF
        _close_fds(ours)
        raise
    return ForkedProcess(pid, status, status_writer, stdin_writer, stdout_reader, stderr_reader)


def _take(fds: list[int], index: int) -> int:
    """``fds[index]``, handed to a transport (which closes it): no longer ours to close."""
    fd, fds[index] = fds[index], -1
    return fd


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)
