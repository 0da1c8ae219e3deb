"""An event type's JSON Schema: checking a schema when a type is added, and a payload
against it when an event is recorded. Pure: no I/O.

A payload that fails is refused with one line naming the field and the rule it breaks
(``payload.eta: required by the schema of shipment.delayed``), never quoting a value of
the payload: the line may reach the application's logs. The schema's own values (a type,
a bound, an enum) may be quoted: they are the catalogue's, not the partner's data.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jsonschema.exceptions

# jsonschema is imported where a schema is checked, not at start-up: it is a third of the
# import time of every `relay` command, and most of them never check a schema.
_SIMPLE_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_SHOWN_CHARS = 80  # of a schema value quoted in a refusal
_COMPILED = 256  # schemas whose validators are kept compiled


def schema_problem(schema: object) -> str | None:
    """Why ``schema`` cannot be an event type's JSON Schema, or None (its draft from
    ``$schema``, 2020-12 by default)."""
    if not isinstance(schema, dict | bool):
        return "a JSON Schema must be a JSON object (or true / false)"
    import jsonschema.exceptions
    import jsonschema.validators

    try:
        validator = jsonschema.validators.validator_for(schema, default=_default_draft())
        validator.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "".join(f"/{p}" for p in exc.absolute_path) or "/"
        return f"not a valid JSON Schema at {where}: {_cut(exc.message)}"
    except jsonschema.exceptions.UnknownType as exc:  # pragma: no cover - rare draft mix
        return f"not a valid JSON Schema: {_cut(str(exc))}"
    return None


@functools.lru_cache(maxsize=_COMPILED)
def _validator(schema_text: str) -> Any:
    """A compiled validator for the schema as canonical JSON (a schema is compiled once,
    not once per event)."""
    import jsonschema.validators

    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema, default=_default_draft())
    return cls(schema)


def _default_draft() -> Any:
    """The draft a schema without "$schema" is read as."""
    import jsonschema

    return jsonschema.Draft202012Validator


def payload_problem(
    schema: Mapping[str, Any] | bool | None, payload: Mapping[str, Any], event_type: str
) -> str | None:
    """Why ``payload`` fails its type's schema, as one line naming the field, or None
    (no schema: any payload)."""
    if schema is None:
        return None
    import jsonschema.exceptions

    validator = _validator(json.dumps(schema, sort_keys=True, separators=(",", ":")))
    error = jsonschema.exceptions.best_match(validator.iter_errors(payload))
    if error is None:
        return None
    return _describe(error, event_type)


def field_path(path: Sequence[object], root: str = "payload") -> str:
    """``payload.a.b[2]``; a name that is not a plain word is written as a JSON string
    (``payload["x y"]``), so the line stays one line whatever the key."""
    text = root
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        elif isinstance(part, str) and _SIMPLE_FIELD.fullmatch(part):
            text += f".{part}"
        else:
            text += f"[{json.dumps(str(part))}]"
    return text


def _describe(error: jsonschema.exceptions.ValidationError, event_type: str) -> str:
    """The refusal of one error: where, and which rule, never the payload's value."""
    path = list(error.absolute_path)
    rule = error.validator
    expected = error.validator_value
    instance = error.instance
    of = f"the schema of {event_type}"
    if rule == "required" and isinstance(instance, dict):
        missing = next((f for f in expected if f not in instance), expected[0])
        return f"{field_path([*path, missing])}: required by {of}"
    if rule in ("additionalProperties", "unevaluatedProperties") and isinstance(instance, dict):
        extra = _extra_field(error.schema, instance)
        if extra is not None:
            return f"{field_path([*path, extra])}: not allowed by {of}"
    if rule == "type":
        return f"{field_path(path)}: must be of type {_shown(expected)} ({of})"
    if rule in ("enum", "const"):
        return f"{field_path(path)}: not one of the values {of} allows ({_shown(expected)})"
    if rule in ("anyOf", "oneOf", "allOf", "not", "if"):
        return f"{field_path(path)}: does not match {of} ({rule})"
    return f"{field_path(path)}: fails {rule} {_shown(expected)} of {of}"


def _extra_field(schema: Mapping[str, Any] | bool, instance: Mapping[str, Any]) -> str | None:
    """The first field of ``instance`` neither named nor matched by the schema."""
    if not isinstance(schema, dict):
        return None
    named = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    for field in instance:
        if field not in named and not any(re.search(p, field) for p in patterns):
            return str(field)
    return None


def _shown(value: object) -> str:
    return _cut(json.dumps(value, separators=(",", ":"), default=str))


def _cut(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _SHOWN_CHARS else flat[: _SHOWN_CHARS - 1] + "…"
