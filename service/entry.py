"""The door: one validation for every way a delivery enters the ledger.

The reminders-file loader (``service.ops.reminders``) and the outbox API
(``service.outbox``) both check what they are given here, so what one accepts the other
accepts, and what enters can be sent: the limits are the send-time limits
(``service.limits``), read by the channel adapters too.

What is checked:

* **identifiers** (reminder ids, outbox keys): :data:`ID_ALPHABET` only, because they
  become the ``Idempotency-Key`` and Standard Webhooks ``webhook-id`` headers of every
  send; reminder ids at most :data:`MAX_REMINDER_ID_CHARS` characters, outbox keys at most
  :data:`MAX_OUTBOX_KEY_CHARS` (the key as sent has at most 256);
* **destinations**: a webhook URL by the destination policy (``service.netpolicy``:
  http(s), no credentials, literal addresses and, with :func:`resolved_problem`, the
  addresses a name resolves to, against ``RELAY_ALLOW_NETWORKS``); an e-mail address by
  ``email-validator`` (syntax only, no DNS); a phone number by ``phonenumbers`` (a valid
  number, written in E.164);
* **payloads**: a JSON object of JSON values only, at most :data:`limits.MAX_PAYLOAD_DEPTH`
  levels deep, no NUL character and no unpaired surrogate in any key or string, and the
  channel's keys and size as the adapter checks them when it sends.

Every check returns the problem as a short reason (``None`` when there is none). A reason
never quotes the value: it may be a recipient's address or a payload.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final
from urllib.parse import urlsplit

import email_validator
import phonenumbers

from service import errors, limits, netpolicy

CHANNELS: Final = ("webhook", "email", "sms")

# Reminder ids and outbox keys. Both Standard Webhooks ids and Idempotency-Key headers
# (sent raw, or as a structured-field string) carry these characters unchanged; ':' is
# kept because keys are written as business identity ("hold:42:expired:email"). No
# space, no '@' or '+' (an address has no place in a key: keys are logged), nothing
# outside ASCII.
ID_ALPHABET: Final = "ASCII letters and digits, '.', '_', ':' and '-'"
_ID = re.compile(r"[A-Za-z0-9._:-]+")
MAX_REMINDER_ID_CHARS: Final = 200  # "reminder:<id>:<UTC instant>:<channel>" stays <= 256
MAX_OUTBOX_KEY_CHARS: Final = limits.MAX_IDEMPOTENCY_KEY_CHARS - len("outbox:")
# Provider names select a rate budget: the names RELAY_BUDGETS can give a budget to.
_PROVIDER = re.compile(r"[A-Za-z0-9._-]{1,100}")
MAX_DESTINATION_CHARS: Final = 2048
# A destination host is resolved at most this long when it enters; a name that does not
# resolve in time is let through (the connect-time check decides when it is used).
DNS_CHECK_SECONDS: Final = 5.0

_E164_EXAMPLE = "+14155550123"
_SURROGATES = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


# ---------------------------------------------------------------------------- identifiers


def identifier_problem(value: object, max_chars: int) -> str | None:
    """Why ``value`` cannot be a reminder id or an outbox key, or None."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if len(value) > max_chars or not _ID.fullmatch(value):
        return f"use 1 to {max_chars} characters: {ID_ALPHABET}"
    return None


def provider_problem(value: object) -> str | None:
    """Why ``value`` cannot name a provider (a rate budget), or None."""
    if not isinstance(value, str) or not _PROVIDER.fullmatch(value):
        return "use 1 to 100 characters: ASCII letters and digits, '.', '_' and '-'"
    return None


_EVENT_TYPE = re.compile(r"[A-Za-z0-9._-]{1,100}")


def event_type_problem(value: object) -> str | None:
    """Why ``value`` cannot be an envelope's event type (``reminder.due``), or None."""
    if not isinstance(value, str) or not _EVENT_TYPE.fullmatch(value):
        return "use 1 to 100 characters: ASCII letters and digits, '.', '_' and '-'"
    return None


# --------------------------------------------------------------------------------- text


def text_problem(text: str) -> str | None:
    """Why a string cannot be stored (PostgreSQL text and jsonb refuse these), or None."""
    if "\x00" in text:
        return "contains a NUL character (\\u0000)"
    if _SURROGATES.search(text):
        return "contains an unpaired surrogate (\\ud800-\\udfff): not valid Unicode"
    return None


def _child_path(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    name = str(key)
    return f"{path}.{name if len(name) <= 40 else name[:37] + '...'}"


def value_problem(value: object, path: str, max_depth: int) -> str | None:
    """The first reason ``value`` is not storable JSON, as ``"path: reason"``, or None.

    Checks, without recursion (so no depth can exhaust the stack): only JSON types
    (objects with string keys, arrays, strings, finite numbers, booleans, null), at most
    ``max_depth`` levels of objects and arrays, and :func:`text_problem` for every key
    and string.
    """
    stack: list[tuple[object, str, int]] = [(value, path, 1)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            problem = text_problem(item)
            if problem is not None:
                return f"{where}: {problem}"
        elif isinstance(item, dict | list | tuple):
            if depth > max_depth:
                return f"{where}: nested deeper than {max_depth} levels"
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        return f"{where}: object keys must be strings"
                    problem = text_problem(key)
                    if problem is not None:
                        return f"{where}: a key {problem}"
                    stack.append((child, _child_path(where, key), depth + 1))
            else:
                stack.extend(
                    (child, _child_path(where, i), depth + 1) for i, child in enumerate(item)
                )
        elif isinstance(item, float):
            if item != item or item in (float("inf"), float("-inf")):
                return f"{where}: not a finite number (NaN and Infinity are not JSON)"
        elif item is not None and not isinstance(item, bool | int):
            return f"{where}: not a JSON value ({type(item).__name__})"
    return None


# A JSON string literal (unrolled loop: linear, no backtracking on long strings).
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON ``text``, without parsing it.

    For checking a line before ``json.loads`` (whose recursion a deep enough line
    exhausts); strings are skipped, so brackets inside them do not count.
    """
    depth = deepest = 0
    for match in _BRACKETS.finditer(_JSON_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


# --------------------------------------------------------------------------- destinations


def destination_problem(
    channel: str, destination: object, allow: netpolicy.AllowList
) -> str | None:
    """Why ``destination`` cannot receive ``channel`` deliveries (static checks), or None.

    Webhook URLs are checked by the destination policy with the ``allow`` networks
    (literal addresses only: :func:`resolved_problem` checks what a name resolves to).
    """
    if not isinstance(destination, str) or not destination.strip():
        return "must be a non-empty string"
    if destination != destination.strip():
        return "must not have leading or trailing spaces"
    if len(destination) > MAX_DESTINATION_CHARS:
        return f"must be at most {MAX_DESTINATION_CHARS} characters"
    if _CONTROL.search(destination) or _SURROGATES.search(destination):
        return "contains a control character"
    if channel == "webhook":
        return netpolicy.url_problem(destination, allow)
    if channel == "email":
        return _email_problem(destination)
    if channel == "sms":
        return _phone_problem(destination)
    return f"unknown channel (expected one of {', '.join(CHANNELS)})"


def _email_problem(address: str) -> str | None:
    try:
        email_validator.validate_email(address, check_deliverability=False)
    except email_validator.EmailNotValidError as exc:
        # The library's reasons name the part that is wrong, never the whole address.
        return f"not a valid e-mail address: {exc}"
    return None


def _phone_problem(number: str) -> str | None:
    e164 = f"not an E.164 phone number ('+', country code and number, e.g. {_E164_EXAMPLE})"
    try:
        parsed = phonenumbers.parse(number, None)
    except phonenumbers.NumberParseException:
        return e164
    if phonenumbers.format_number(parsed, phonenumbers.PhoneNumberFormat.E164) != number:
        return e164 + "; no spaces, dashes or brackets"
    if not phonenumbers.is_valid_number(parsed):
        return "not a valid phone number (no such number range in its country)"
    return None


async def resolved_problem(
    destination: str,
    allow: netpolicy.AllowList,
    verdicts: dict[tuple[str, int], str | None] | None = None,
    *,
    timeout_seconds: float = DNS_CHECK_SECONDS,
) -> str | None:
    """Why a webhook URL's host resolves to a refused address, or None.

    A name that does not resolve within ``timeout_seconds`` (or at all) is let
    through: the connect-time check in the webhook adapter decides when it is used.
    ``verdicts`` caches the answer per (host, port), e.g. across a file.
    """
    parts = urlsplit(destination)
    target = (parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
    if verdicts is not None and target in verdicts:
        return verdicts[target]
    verdict: str | None = None
    try:
        await asyncio.wait_for(netpolicy.resolve_and_check(*target, allow), timeout_seconds)
    except netpolicy.DestinationRefused as exc:
        verdict = exc.reason
    except (OSError, TimeoutError, UnicodeError):
        verdict = None
    if verdicts is not None:
        verdicts[target] = verdict
    return verdict


# ------------------------------------------------------------------------------- payloads


def payload_problem(
    channel: str, payload: object, destination: str, path: str = "payload"
) -> str | None:
    """Why ``payload`` cannot be sent to ``destination`` on ``channel``, as
    ``"path: reason"``, or None.

    The keys and limits are those the channel adapter checks when it sends (webhook: any
    object, its JSON body at most 256 KiB; e-mail: ``subject``, ``text``, optional
    ``html``, the request at most 512 KiB with room kept for the sender; SMS: ``body`` of
    at most 1,600 UTF-16 units), so a payload that enters is not refused at send time.
    """
    if not isinstance(payload, dict):
        return f"{path}: must be a JSON object"
    problem = value_problem(payload, path, limits.MAX_PAYLOAD_DEPTH)
    if problem is not None:
        return problem
    try:
        body = _compact(payload)
    except ValueError:  # e.g. an integer of more than 4,300 digits
        return f"{path}: not JSON-serializable"
    if len(body) > limits.MAX_PAYLOAD_BYTES:
        return f"{path}: {_too_large(len(body), limits.MAX_PAYLOAD_BYTES)}"
    if channel == "webhook" and len(body) > limits.WEBHOOK_MAX_BODY_BYTES:
        return f"{path}: {_too_large(len(body), limits.WEBHOOK_MAX_BODY_BYTES)} for a webhook"
    if channel == "email":
        return _email_payload_problem(payload, destination, path)
    if channel == "sms":
        return _sms_payload_problem(payload, path)
    return None


def _compact(value: Any) -> bytes:
    """The JSON as the webhook adapter sends it."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def _too_large(size: int, limit: int) -> str:
    return f"too large ({size:,} bytes as JSON; the limit is {limit:,})"


def _email_payload_problem(payload: Mapping[str, Any], destination: str, path: str) -> str | None:
    for key in ("subject", "text"):
        if key not in payload:
            return f"{path}: '{key}' is required for e-mail"
        if not isinstance(payload[key], str):
            return f"{path}.{key}: must be a string"
    subject: str = payload["subject"]
    if not subject.strip() or "\r" in subject or "\n" in subject:
        return f"{path}.subject: must be one non-blank line"
    if payload.get("html") is not None and not isinstance(payload["html"], str):
        return f"{path}.html: must be a string"
    # The request as the adapter builds it, with an empty sender and no delivery tag, and
    # room kept for both.
    message: dict[str, object] = {
        "from": "",
        "to": [destination],
        "subject": subject,
        "text": payload["text"],
    }
    if payload.get("html") is not None:
        message["html"] = payload["html"]
    size = len(json.dumps(message, ensure_ascii=False).encode("utf-8"))
    limit = (
        limits.EMAIL_MAX_REQUEST_BYTES - limits.EMAIL_MAX_SENDER_BYTES - limits.EMAIL_MAX_TAGS_BYTES
    )
    if size > limit:
        return f"{path}: {_too_large(size, limit)} for an e-mail"
    return None


def _sms_payload_problem(payload: Mapping[str, Any], path: str) -> str | None:
    if "body" not in payload:
        return f"{path}: 'body' is required for SMS"
    body = payload["body"]
    if not isinstance(body, str) or not body.strip():
        return f"{path}.body: must be a non-blank string"
    units = len(body.encode("utf-16-le")) // 2
    if units > limits.SMS_MAX_BODY_CHARS:
        return (
            f"{path}.body: too long ({units:,} UTF-16 units; "
            f"the SMS limit is {limits.SMS_MAX_BODY_CHARS:,})"
        )
    return None


def option_time(value: str | None, name: str) -> datetime | None:
    """An ISO 8601 time with a UTC offset from a command's option ``name`` (exit 2 otherwise)."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise errors.ConfigError(f"{name}: not an ISO 8601 time: {value!r}") from None
    if parsed.tzinfo is None:
        raise errors.ConfigError(f"{name}: needs a UTC offset, e.g. {value}+00:00")
    return parsed
