"""A fork server for the tests' ``relay`` processes (run as ``python -m tests.support.zygote``).

Starting ``python -m service.ops.cli`` costs ~1 CPU-second on the test machine before the
command does anything (aiohttp, aio-pika, asyncpg, pydantic, OpenTelemetry); the suite
starts a few hundred such processes. This server imports all of that once, then forks one
child per request: each child is a real process with its own pid (tests SIGKILL it by pid,
it exits with its own code), its own stdin, stdout and stderr, environment and working
directory, running ``service.ops.cli.main`` as ``relay`` would. Nothing runs here but the
imports, so a child starts from the state a fresh interpreter reaches after importing.

Protocol, on a Unix socket given as the only argument: the client sends one message (a
4-byte length, then JSON ``{"args", "env", "cwd"}``) with three file descriptors (stdin,
stdout, stderr) attached; the server answers ``PID\\n`` at once and ``CODE\\n`` when the
child exits (as asyncio's ``returncode``: negative for a signal). The server exits when its
stdin closes (the test worker that started it is gone).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import pkgutil
import random
import selectors
import signal
import socket
import struct
import sys
import threading
import traceback
from typing import Any

# What a relay process imports, loaded once here; the console's browser-facing modules too.
_PACKAGES = ("service", "publisher", "consumer")


def _preload() -> None:
    for name in _PACKAGES:
        package = importlib.import_module(name)
        for module in pkgutil.walk_packages(package.__path__, f"{name}."):
            if not module.name.endswith("__main__"):
                importlib.import_module(module.name)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    (length,) = struct.unpack("!I", data[:4])
    body = data[4:]
    while len(body) < length:
        chunk = conn.recv(length - len(body))
        if not chunk:
            raise ConnectionError("client went away mid-request")
        body += chunk
    if len(fds) != 3:
        raise ConnectionError(f"expected 3 file descriptors, got {len(fds)}")
    request: dict[str, Any] = json.loads(body)
    return request, fds


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _run_child(request: dict[str, Any], fds: list[int], inherited: list[Any]) -> None:
    """In the forked child: become ``relay ARGS`` and never return."""
    code = 1
    try:
        for resource in inherited:  # the server's sockets and pidfds are not the child's
            resource.close() if hasattr(resource, "close") else os.close(resource)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        # A fresh interpreter's signal dispositions (the worker that started this server
        # ignores SIGINT; a relay started from a shell does not).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()  # each child its own sequence, as a fresh process would have
        from service.ops import cli

        args = list(request["args"])
        sys.argv = [cli.__file__, *args]
        code = cli.main(args)
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # reported as a fresh interpreter would report it
        traceback.print_exc()
        code = 1
    finally:
        # What a normal interpreter exit does: wait for non-daemon threads, run the
        # atexit handlers (OpenTelemetry's flush), flush stdio.
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve(path: str) -> None:
    _preload()
    if threading.active_count() != 1:  # forking a threaded process is not safe
        raise SystemExit(f"zygote: an import started a thread: {threading.enumerate()}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, client)
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                return  # stdin closed: the worker is gone; the children live on
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError) as exc:
                    print(f"zygote: bad request: {exc}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                inherited: list[Any] = [selector, listener, conn, *children]
                inherited += [client for _, client in children.values()]
                pid = os.fork()
                if pid == 0:
                    _run_child(request, fds, inherited)
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn)
                selector.register(pidfd, selectors.EVENT_READ, "child")
                _send(conn, f"{pid}\n")
            else:  # a child exited
                pidfd = key.fd
                pid, conn = children.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                _send(conn, f"{os.waitstatus_to_exitcode(status)}\n")
                conn.close()


def _send(conn: socket.socket, text: str) -> None:
    try:
        conn.sendall(text.encode())
    except OSError:
        pass  # the test stopped listening (it never waited for this process)


def request_bytes(args: list[str], env: dict[str, str], cwd: str) -> bytes:
    body = json.dumps({"args": args, "env": env, "cwd": cwd}).encode()
    return struct.pack("!I", len(body)) + body


if __name__ == "__main__":
    serve(sys.argv[1])
