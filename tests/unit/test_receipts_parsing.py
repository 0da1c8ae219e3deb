"""The providers' signature schemes and callback shapes, read without any I/O."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from service import receipt_events, receipt_signatures
from service.ops.email_provider import sign_svix
from service.receipt_events import ReceiptEvent, Refused

# Twilio's own validator's test vector (twilio-python tests/unit/test_request_validator.py).
TOKEN = "12345"
URL = "https://mycompany.com/myapp.php?foo=1&bar=2"
PARAMS = {
    "CallSid": "CA1234567890ABCDE",
    "Digits": "1234",
    "From": "+14158675309",
    "To": "+18005551212",
    "Caller": "+14158675309",
}
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def test_twilio_signature_matches_twilios_documented_vectors() -> None:
    assert receipt_signatures.twilio_signature(TOKEN, URL, PARAMS.items()) == (
        "RSOYDt4T1cUTdK1PDd93/VVr8B8="
    )
    repeated = [("Sid", "CA123"), ("SidAccount", "AC123"), ("Digits", "5678"), ("Digits", "1234")]
    assert receipt_signatures.twilio_signature(TOKEN, URL, repeated) == (
        "IK+Dwps556ElfBT0I3Rgjkr1wJU="
    )


@pytest.mark.parametrize(
    ("url", "signature"),
    [
        (URL, "RSOYDt4T1cUTdK1PDd93/VVr8B8="),
        (URL.replace(".com", ".com:1234"), "RSOYDt4T1cUTdK1PDd93/VVr8B8="),  # port removed
        (URL, "kvajT1Ptam85bY51eRf/AJRuM3w="),  # signed with :443
        (URL.replace("https", "http"), "0ZXoZLH/DfblKGATFgpif+LLRf4="),  # signed with :80
    ],
)
def test_twilio_verification_accepts_the_url_with_or_without_its_port(
    url: str, signature: str
) -> None:
    receipt_signatures.verify_twilio(TOKEN, url, PARAMS.items(), signature)


@pytest.mark.parametrize("signature", [None, "", "RSOYDt4T1cUTdK1PDd93/VVr8B8X"])
def test_twilio_verification_refuses_a_missing_or_wrong_signature(signature: str | None) -> None:
    with pytest.raises(receipt_signatures.BadSignature):
        receipt_signatures.verify_twilio(TOKEN, URL, PARAMS.items(), signature)
    with pytest.raises(receipt_signatures.BadSignature):
        receipt_signatures.verify_twilio(
            TOKEN, URL, {**PARAMS, "Digits": "9"}.items(), "RSOYDt4T1cUTdK1PDd93/VVr8B8="
        )


def test_svix_headers_verify_with_any_current_secret_and_only_on_time() -> None:
    body = b'{"type": "email.delivered"}'
    now = datetime.now(UTC)
    headers = sign_svix(SECRET, body, "msg_1", now)
    receipt_signatures.verify_svix(["whsec_b3RoZXI=", SECRET], body, headers)
    assert receipt_signatures.svix_message_id(headers) == "msg_1"
    for bad in (
        {},
        {**headers, "svix-signature": "v1,AAAA"},
        {**headers, "svix-signature": "garbage"},
        sign_svix(SECRET, body, "msg_1", now - timedelta(minutes=6)),
        sign_svix(SECRET, body, "msg_1", now + timedelta(minutes=6)),
    ):
        with pytest.raises(receipt_signatures.BadSignature):
            receipt_signatures.verify_svix([SECRET], body, bad)
    with pytest.raises(receipt_signatures.BadSignature):
        receipt_signatures.verify_svix([SECRET], body + b" ", headers)


def _email(kind: str, **data: object) -> object:
    return {
        "type": kind,
        "created_at": "2026-03-01T06:00:01.5Z",
        "data": {"email_id": "e-1", **data},
    }


def test_email_events_map_to_outcomes_with_the_delivery_tag_in_either_shape() -> None:
    hard = _email(
        "email.bounced",
        bounce={"type": "Permanent", "subType": "General"},
        tags={"relay_delivery": "42"},
    )
    event = receipt_events.email_event(hard, "msg_9")
    assert event == ReceiptEvent(
        channel="email",
        provider_message_id="e-1",
        event_key="msg_9",
        event="email.bounced",
        outcome="bounced",
        permanent=True,
        reason="Permanent/General",
        provider_at=datetime(2026, 3, 1, 6, 0, 1, 500000, tzinfo=UTC),
        delivery_hint=42,
    )
    soft = _email(
        "email.bounced",
        bounce={"type": "Transient"},
        tags=[{"name": "relay_delivery", "value": "7"}],
    )
    parsed = receipt_events.email_event(soft, "m")
    assert isinstance(parsed, ReceiptEvent)
    assert (parsed.permanent, parsed.delivery_hint, parsed.reason) == (False, 7, "Transient")
    complaint = receipt_events.email_event(_email("email.complained"), "m")
    assert isinstance(complaint, ReceiptEvent) and complaint.permanent
    delayed = receipt_events.email_event(_email("email.delivery_delayed"), "m")
    assert isinstance(delayed, ReceiptEvent) and delayed.outcome == "delayed"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ([], 400),
        ({"type": "email.delivered"}, 400),
        ({"type": "email.delivered", "data": {"email_id": "bad id with spaces"}}, 400),
        ({"type": "email.opened", "data": {"email_id": "e-1"}}, 422),
        ({"type": 7, "data": {"email_id": "e-1"}}, 422),
    ],
)
def test_email_bodies_the_ledger_cannot_take_are_refused(body: object, status: int) -> None:
    refused = receipt_events.email_event(json.loads(json.dumps(body)), "m")
    assert isinstance(refused, Refused) and refused.status == status


@pytest.mark.parametrize(
    ("status", "code", "outcome", "permanent"),
    [
        ("queued", None, "sent", False),
        ("sent", None, "sent", False),
        ("delivered", None, "delivered", False),
        ("undelivered", "30005", "bounced", True),
        ("undelivered", "30003", "bounced", False),
        ("failed", "21610", "bounced", True),
        ("failed", "30008", "bounced", False),
    ],
)
def test_sms_statuses_map_to_outcomes_and_permanent_codes(
    status: str, code: str | None, outcome: str, permanent: bool
) -> None:
    params = {"MessageSid": "SM" + "1" * 32, "MessageStatus": status}
    if code:
        params["ErrorCode"] = code
    event = receipt_events.sms_status(params, {"delivery": "12"})
    assert isinstance(event, ReceiptEvent)
    assert (event.outcome, event.permanent, event.delivery_hint) == (outcome, permanent, 12)
    assert event.event_key == f"SM{'1' * 32}:{status}:{code or ''}"


def test_sms_callbacks_without_a_sid_or_with_an_unknown_status_are_refused() -> None:
    assert isinstance(receipt_events.sms_status({"MessageStatus": "sent"}, {}), Refused)
    unknown = receipt_events.sms_status({"MessageSid": "SM1", "MessageStatus": "received"}, {})
    assert isinstance(unknown, Refused) and unknown.status == 422


def test_outcomes_are_ordered_so_the_strongest_wins() -> None:
    assert receipt_events.OUTCOMES.index("bounced") > receipt_events.OUTCOMES.index("delivered")
    assert receipt_events.OUTCOMES.index("delivered") > receipt_events.OUTCOMES.index("delayed")
