"""The settings of the operator console (`relay console`). Part of
``service.settings.Settings`` (which inherits them, with the ``RELAY_`` prefix); kept apart
so each settings module stays readable.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
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
    console_token: SecretStr | None = Field(
        default=None,
        description="The operator token the console asks for (or a file via "
        "RELAY_CONSOLE_TOKEN_FILE / RELAY_SECRETS_DIR). Never logged.",
    )
    console_token_file: Path | None = Field(
        default=None,
        description="File holding the operator token (a mounted Kubernetes Secret).",
    )
    console_open_reads: bool = Field(
        default=False,
        description="Let read-only console pages and GET /api/v1 through without the token "
        "(actions still need it).",
    )
