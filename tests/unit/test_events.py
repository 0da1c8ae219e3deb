"""Pure parts of events: type names, subscription patterns and filters, and the one-line
refusal of a payload that fails its type's JSON Schema (naming the field, never a value)."""

from __future__ import annotations

from typing import Any

import pytest

from service import event_schema, events, subscriptions

SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["shipment", "eta"],
    "additionalProperties": False,
    "properties": {
        "shipment": {"type": "integer", "minimum": 1},
        "eta": {"type": "string"},
        "region": {"enum": ["eu", "us"]},
        "stops": {"type": "array", "items": {"type": "object", "required": ["at"]}},
        "odd key": {"type": "string"},
    },
}


@pytest.mark.parametrize(
    ("payload", "line"),
    [
        ({"eta": "x"}, "payload.shipment: required by the schema of t.x"),
        ({"shipment": "SECRET", "eta": "x"}, 'payload.shipment: must be of type "integer"'),
        ({"shipment": 0, "eta": "x"}, "payload.shipment: fails minimum 1 of the schema of t.x"),
        ({"shipment": 1, "eta": "x", "region": "SECRET"}, "payload.region: not one of the values"),
        ({"shipment": 1, "eta": "x", "SECRET": 1}, "payload.SECRET: not allowed by"),
        ({"shipment": 1, "eta": "x", "stops": [{"at": 1}, {}]}, "payload.stops[1].at: required"),
        ({"shipment": 1, "eta": "x", "odd key": 3}, 'payload["odd key"]: must be of type'),
    ],
)
def test_a_payload_failing_the_schema_is_one_line_naming_the_field(
    payload: dict[str, Any], line: str
) -> None:
    problem = event_schema.payload_problem(SCHEMA, payload, "t.x")
    assert problem is not None and problem.startswith(line) and "\n" not in problem
    values = [v for v in payload.values() if v == "SECRET"]
    assert not values or ("'SECRET'" not in problem and '"SECRET"' not in problem)


def test_a_payload_that_fits_or_a_type_without_schema_passes() -> None:
    assert event_schema.payload_problem(SCHEMA, {"shipment": 1, "eta": "x"}, "t.x") is None
    assert event_schema.payload_problem(None, {"anything": [1, 2]}, "t.x") is None


def test_a_schema_is_checked_against_its_draft() -> None:
    assert event_schema.schema_problem(SCHEMA) is None
    assert event_schema.schema_problem(True) is None
    bad = event_schema.schema_problem({"type": "no-such-type"})
    assert bad is not None and bad.startswith("not a valid JSON Schema at /type")
    assert (
        event_schema.schema_problem([1]) == "a JSON Schema must be a JSON object (or true / false)"
    )
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object"}
    assert event_schema.schema_problem(draft7) is None


@pytest.mark.parametrize("name", ["shipment.delayed", "a", "order_v2.paid-late", "x" * 100])
def test_valid_type_names(name: str) -> None:
    assert events.type_name_problem(name) is None


@pytest.mark.parametrize("name", ["", ".a", "a.", "a..b", "a.*", "*", "a b", "x" * 101, 3])
def test_invalid_type_names(name: object) -> None:
    assert events.type_name_problem(name) is not None


@pytest.mark.parametrize(
    ("pattern", "event_type", "takes"),
    [
        ("shipment.delayed", "shipment.delayed", True),
        ("shipment.delayed", "shipment.delayed.late", False),
        ("shipment.*", "shipment.delayed", True),
        ("shipment.*", "shipment.eta.changed", True),
        ("shipment.*", "shipment", False),
        ("shipment.*", "shipments.delayed", False),
        ("*", "order.paid", True),
    ],
)
def test_patterns_take_exact_names_prefixes_and_everything(
    pattern: str, event_type: str, takes: bool
) -> None:
    assert subscriptions.pattern_problem(pattern) is None
    assert subscriptions.matches(pattern, event_type) is takes


@pytest.mark.parametrize("pattern", ["shipment.*.x", "*.delayed", "shipment*", ".*", "a..b", ""])
def test_malformed_patterns_are_refused(pattern: str) -> None:
    assert subscriptions.pattern_problem(pattern) is not None


def test_a_filter_reads_json_values_and_groups_them_by_field() -> None:
    parsed = subscriptions.parse_filter(
        ["region=eu", "region=uk", "priority=1", "vip=true", "note=null", 'code="7"', "region=eu"]
    )
    assert parsed == {
        "code": ["7"],
        "note": [None],
        "priority": [1],
        "region": ["eu", "uk"],
        "vip": [True],
    }
    assert subscriptions.describe_filter(parsed).startswith('code = "7", note = null')
    assert subscriptions.describe_filter({}) == "no filter"


@pytest.mark.parametrize("item", ["region", "=eu", "a b=1", "x={}", "x=[1]"])
def test_a_malformed_filter_is_refused(item: str) -> None:
    with pytest.raises(subscriptions.SubscriptionRefused, match="--filter"):
        subscriptions.parse_filter([item])


def test_a_delivery_key_fits_every_receiver() -> None:
    key = events.delivery_key("k" * events.MAX_KEY_CHARS, 2**63 - 1)
    assert len(key) == 256
