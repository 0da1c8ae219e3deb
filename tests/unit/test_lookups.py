"""How reconciliation reads a provider's list: the one message of this delivery is found,
an older one ends the search, others are read past (pure: the adapters' matchers)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from consumer.channels import email, sms
from consumer.channels.base import Lookup, LookupRequest

SINCE = datetime(2026, 3, 1, 6, 0, tzinfo=UTC)


def _request(destination: str, payload: dict[str, object]) -> LookupRequest:
    return LookupRequest(7, "reminder:r:2026-03-01T06:00:00Z:x", destination, payload, SINCE)


def test_an_email_to_this_recipient_with_this_subject_since_the_occurrence_is_found() -> None:
    request = _request("Ann@Example.com", {"subject": "Report", "text": "t"})
    mine = {
        "id": "e-1",
        "to": ["ann@example.com"],
        "subject": "Report",
        "last_event": "delivered",
        "created_at": "2026-03-01T06:00:02.000000+00:00",
    }
    assert email._match(mine, request, SINCE) == Lookup("found", "e-1", "delivered")
    other = {**mine, "subject": "Another"}
    assert email._match(other, request, SINCE) is None
    older = {**mine, "created_at": "2026-03-01T05:59:00Z"}
    assert email._match(older, request, SINCE) == Lookup("not_found")


def test_an_sms_to_this_number_with_this_body_since_the_occurrence_is_found() -> None:
    import hashlib

    digest = hashlib.sha256(b"Hold expires").digest()
    mine = {
        "sid": "SM1",
        "body": "Hold expires",
        "status": "sent",
        "date_created": "Sun, 01 Mar 2026 06:00:03 +0000",
    }
    assert sms._match(mine, digest, SINCE) == Lookup("found", "SM1", "sent")
    assert sms._match({**mine, "body": "Other"}, digest, SINCE) is None
    older = {**mine, "date_created": "Sun, 01 Mar 2026 05:00:00 +0000"}
    assert sms._match(older, digest, SINCE - timedelta(minutes=5)) == Lookup("not_found")
