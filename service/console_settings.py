"""The settings of the operator console (`relay console`). Part of
``service.settings.Settings`` (which inherits them, with the ``RELAY_`` prefix); kept apart
so each settings module stays readable.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings


class ConsoleSettings(BaseSettings):
    """Console fields of ``Settings``; environment variable = ``RELAY_`` + field name."""

    console_host: str = Field(
        default="127.0.0.1",
        description="Address `relay console` listens on (loopback: reach it by port-forward).",
    )
    console_port: int = Field(
        default=8088, ge=0, le=65535, description="Port of `relay console` (0: any free port)."
    )
    console_operators_file: Path | None = Field(
        default=None,
        description="The console's operators: one `NAME:HASH` line each (the scrypt hash of "
        "their own token; `relay console-operators add NAME --file FILE` makes both). A "
        "mounted Secret; read again when it changes, so removing a line revokes at once.",
    )
    console_https: bool = Field(
        default=False,
        description="The console is reached over HTTPS (a TLS ingress) or on loopback: its "
        "session cookie is `__Host-relay_console`, `Secure` (on in the Kubernetes manifests).",
    )
    console_session_idle_minutes: float = Field(
        default=30.0,
        gt=0,
        le=24 * 60,
        description="A console session not used for this long ends (min).",
    )
    console_session_max_hours: float = Field(
        default=12.0,
        gt=0,
        le=7 * 24,
        description="A console session ends this long after its log-in, used or not (h).",
    )
    console_proxy_hops: int = Field(
        default=0,
        ge=0,
        le=5,
        description="Trusted proxies (an ingress) in front of the console: the login "
        "throttle takes the client address they append to X-Forwarded-For (0: the peer).",
    )
    console_open_reads: bool = Field(
        default=False,
        description="Let read-only console pages and GET /api/v1 through without the token "
        "(actions and reveals still need it).",
    )
