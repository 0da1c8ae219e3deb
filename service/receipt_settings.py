"""The settings of provider receipts (`relay receipts`) and reconciliation. Part
of ``service.settings.Settings`` (which inherits them, with the ``RELAY_`` prefix); kept
apart so each settings module stays readable.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode


class ReceiptSettings(BaseSettings):
    """Receipt fields of ``Settings``; environment variable = ``RELAY_`` + field name."""

    receipts_host: str = Field(
        default="0.0.0.0", description="Address `relay receipts` listens on."
    )
    receipts_port: int = Field(
        default=8082,
        ge=0,
        le=65535,
        description="Port of `relay receipts`: the providers' status callbacks, /livez, "
        "/readyz, /metrics (0: any free port).",
    )
    receipts_public_url: str = Field(
        default="",
        description="The address providers reach `relay receipts` at, e.g. "
        "https://relay.example.com (no path). Twilio signs the URL it called, so a callback "
        "is checked against this address; and each SMS asks for its status callbacks at "
        "<this>/receipts/sms. Empty: a callback is checked against the address it came to, "
        "and SMS ask for none (configure one at the provider).",
    )
    email_webhook_secrets: Annotated[list[SecretStr], NoDecode] = Field(
        default=[],
        description="Signing secrets (whsec_...) of the e-mail provider's webhook (Resend: "
        "the endpoint's signing secret), comma-separated; several during a rotation. "
        "Empty: `relay receipts` takes no e-mail callbacks.",
    )
    receipt_wait_seconds: float = Field(
        default=900.0,
        gt=0,
        description="An e-mail or SMS the provider accepted this long ago without a receipt "
        "is reported as 'no receipt' (relay status, --missing) (s).",
    )

    reconcile_hold_seconds: float = Field(
        default=60.0,
        gt=0,
        description="Before an SMS is sent again after an attempt that may have reached the "
        "provider unanswered, the provider is asked whether it has the message; when it "
        "cannot say, the SMS is held this long and the provider asked again (s). No attempt "
        "is counted, and no number gets a second text.",
    )

    @field_validator("email_webhook_secrets", mode="before")
    @classmethod
    def _split_email_secrets(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("receipts_public_url")
    @classmethod
    def _receipts_public_url(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if value and not (value.startswith("https://") or value.startswith("http://")):
            raise ValueError("must be an http(s) URL, e.g. https://relay.example.com")
        if value and "/" in value.split("://", 1)[1]:
            raise ValueError("give the address only, without a path")
        return value
