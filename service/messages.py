"""The wire message: a delivery id and a schema version, nothing that can go stale.

Everything a send needs is read from the ledger at send time, so a message may be
duplicated, delayed or replayed without ever carrying an outdated payload.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1


class MessageError(ValueError):
    """A body that is not a valid delivery message; the text is the dead-letter reason."""


class DeliveryMessage(BaseModel):
    """``{"v": 1, "delivery_id": 123}``."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    v: Literal[1]
    delivery_id: int = Field(gt=0)


def encode(delivery_id: int) -> bytes:
    """The body for one delivery."""
    return json.dumps({"v": SCHEMA_VERSION, "delivery_id": delivery_id}).encode()


def decode(body: bytes) -> DeliveryMessage:
    """Parse a body; raise MessageError with a short reason fit for a dead-letter header."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        raise MessageError("undecodable body: not JSON") from None
    if not isinstance(data, dict):
        raise MessageError("invalid message: not a JSON object")
    if data.get("v") != SCHEMA_VERSION:
        raise MessageError(f"unsupported schema version: {str(data.get('v'))[:20]}")
    try:
        return DeliveryMessage.model_validate(data)
    except ValidationError as exc:
        fields = ",".join(str(e["loc"][0]) for e in exc.errors() if e["loc"])
        raise MessageError(f"invalid message: bad field(s) {fields or '?'}") from None
