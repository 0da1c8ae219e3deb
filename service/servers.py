"""Why a server (the database, the broker) could not be reached, in a few words.

Shared by ``service.db`` and ``service.amqp`` so both say "connection refused", "unknown
host" or "timed out" the same way. The words never include a URL or a credential.
"""

from __future__ import annotations

import errno
import socket
import ssl


def connect_cause(exc: BaseException, timeout_seconds: float, timeout_setting: str) -> str:
    """Why a TCP connection failed: refused, unknown host, timeout (naming the setting that
    bounds it), TLS, or the OS's reason."""
    if isinstance(exc, TimeoutError):
        return f"timed out: no answer within {timeout_seconds:g} s ({timeout_setting})"
    if isinstance(exc, socket.gaierror):
        return "unknown host (the name does not resolve)"
    if isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED:
        return "connection refused (nothing listens there)"
    if "Connect call failed" in str(exc):  # several addresses tried, each refused
        return "connection refused (nothing listens there)"
    if isinstance(exc, EOFError):  # e.g. asyncio.IncompleteReadError
        return "the server closed the connection without answering (the wrong port?)"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed ({exc.reason or type(exc).__name__})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return f"connection failed ({type(exc).__name__})"
