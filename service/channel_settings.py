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
    destination_secrets_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default=[],
        description="Fernet keys (urlsafe base64 of 32 bytes), comma-separated, that encrypt "
        "the destinations' own signing secrets at rest: the first encrypts, every one "
        "decrypts (key rotation: put the new key first, run `relay destinations rekey`, "
        "then drop the old one). Empty: destinations get no secret of their own and are "
        "signed with RELAY_WEBHOOK_SIGNING_SECRETS.",
    )
    destinations_registered_only: bool = Field(
        default=False,
        description="Refuse a reminder or outbox intent whose webhook destination is not "
        "registered (`relay destinations add`), instead of registering it on first use.",
    )
    destination_failure_streak: int = Field(
        default=10,
        ge=0,
        description="Consecutive failed attempts (5xx, timeouts, connection failures, "
        "4xx answers) after which a destination is disabled, once the streak also spans "
        "RELAY_DESTINATION_FAILURE_SPAN_SECONDS. 0: never.",
    )
    destination_failure_span_seconds: float = Field(
        default=3600.0,
        ge=0,
        description="The least time a failure streak must span before it disables its "
        "destination (s), so a short outage does not.",
    )
    destination_hold_seconds: float = Field(
        default=60.0,
        gt=0,
        description="How long a delivery to a disabled destination is parked before it "
        "looks again (s); no attempt is counted. `relay destinations enable` makes held "
        "deliveries due, so they go out within this time.",
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

    @field_validator("destination_secrets_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("destination_secrets_keys")
    @classmethod
    def _keys_are_fernet_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        from cryptography.fernet import Fernet

        for index, key in enumerate(value):
            try:
                Fernet(key.get_secret_value().encode())
            except ValueError:
                # Never echo the key itself.
                raise ValueError(
                    f"key {index + 1} is not a Fernet key (urlsafe base64 of 32 bytes; make "
                    "one with `python -c 'from cryptography.fernet import Fernet; "
                    "print(Fernet.generate_key().decode())'`)"
                ) from None
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
