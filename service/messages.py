"""The wire message: a delivery id and a schema version, nothing that can go stale.

Everything a send needs is read from the ledger at send time, so a message may be
duplicated, delayed or replayed without ever carrying an outdated payload.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1
# Bounds checked before parsing: a real body is ~35 bytes. The size bound also bounds
# nesting depth far below the parser's recursion limit.
MAX_BODY_BYTES = 1024
MAX_DELIVERY_ID = 2**63 - 1  # bigint


class MessageError(ValueError):
    """A body that is not a valid delivery message; the text is the dead-letter reason."""


class DeliveryMessage(BaseModel):
    """``{"v": 1, "delivery_id": 123}``."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    v: Literal[1]
    delivery_id: int = Field(gt=0, le=MAX_DELIVERY_ID)


def encode(delivery_id: int) -> bytes:
    """The body for one delivery."""
    return json.dumps({"v": SCHEMA_VERSION, "delivery_id": delivery_id}).encode()


def decode(body: bytes) -> DeliveryMessage:
    """Parse a body; raise MessageError with a short reason fit for a dead-letter header."""
    if len(body) > MAX_BODY_BYTES:
        raise MessageError(f"oversized body: more than {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise MessageError("undecodable body: not JSON") from None
    if not isinstance(data, dict):
        raise MessageError("invalid message: not a JSON object")
    version = data.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:  # not True, not 1.0
        raise MessageError(f"unsupported schema version: {str(data.get('v'))[:20]}")
    try:
        return DeliveryMessage.model_validate(data)
    except ValidationError as exc:
        fields = ",".join(str(e["loc"][0]) for e in exc.errors() if e["loc"])
        raise MessageError(f"invalid message: bad field(s) {fields or '?'}") from None
