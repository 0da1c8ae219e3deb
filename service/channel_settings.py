"""The settings of the channel adapters: webhook signing, the e-mail and SMS provider
APIs, and the networks destinations may resolve to. Part of ``service.settings.Settings``
(which inherits them, with the ``RELAY_`` prefix); kept apart because they are many.
"""

from __future__ import annotations

import json
from typing import Annotated

import email_validator
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode

from service import limits


class ChannelSettings(BaseSettings):
    """Channel fields of ``Settings``; environment variable = ``RELAY_`` + field name."""

    webhook_signing_secrets: Annotated[list[SecretStr], NoDecode] = Field(
        default=[],
        description="Standard Webhooks secrets (whsec_...), comma-separated; several during "
        "rotation. Empty: requests are not signed.",
    )
    email_api_base_url: str = Field(
        default="https://api.resend.com",
        description="Base URL of the HTTP email API (Resend-style POST /emails).",
    )
    email_api_key: SecretStr = Field(
        default=SecretStr(""), description="Email API key. Empty: the email channel is off."
    )
    email_sender: str = Field(
        default="",
        description="From address of reminder e-mails, optionally with a name, e.g. "
        "'Reminders <r@x.com>'; at most 1 KiB.",
    )
    sms_api_base_url: str = Field(
        default="https://api.twilio.com",
        description="Base URL of the HTTP SMS API (Twilio-style Messages resource).",
    )
    sms_account_sid: str = Field(
        default="", description="SMS account id (AC + 32 hex). Empty: the SMS channel is off."
    )
    sms_auth_token: SecretStr = Field(default=SecretStr(""), description="SMS API auth token.")
    sms_from_number: str = Field(default="", description="Sender number (E.164).")
    sms_messaging_service_sid: str = Field(
        default="", description="Sender service id (MG...), instead of a from number."
    )
    allow_networks: str = Field(
        default="",
        description="Comma-separated CIDRs that destinations may resolve to although not "
        "public (e.g. 127.0.0.0/8 for local demos). Empty: only public addresses.",
    )

    @field_validator("webhook_signing_secrets", mode="before")
    @classmethod
    def _split_secrets(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("email_sender")
    @classmethod
    def _sender_is_an_address(cls, value: str) -> str:
        if not value:
            return value
        if len(json.dumps(value, ensure_ascii=False).encode()) - 2 > limits.EMAIL_MAX_SENDER_BYTES:
            raise ValueError(f"must be at most {limits.EMAIL_MAX_SENDER_BYTES} bytes")
        try:
            email_validator.validate_email(
                value, check_deliverability=False, allow_display_name=True
            )
        except email_validator.EmailNotValidError as exc:
            raise ValueError(
                f"not an e-mail address ('Name <a@b.example>' or 'a@b.example'): {exc}"
            ) from None
        return value
