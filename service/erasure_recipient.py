"""Who ``relay erase`` erases: the recipient as the operator wrote it, normalised as the
entry and the suppression list compare it, and the regular expression that finds each
mention of it in free text.

* an e-mail address (it has an ``@``): checked by ``email-validator`` (syntax, no DNS) as
  the entry checks it, and compared lower-cased, as ``suppression_address`` and the
  providers do: ``Ann@Example.com`` is ``ann@example.com``;
* a phone number (anything else): parsed by ``phonenumbers`` in international form
  (``+``, country code; spaces, dashes and brackets allowed here) and written in E.164,
  the only form the entry lets in: ``+1 (415) 555-0123`` is ``+14155550123``;
* a webhook URL (it has ``://``): normalised as the destinations registry does
  (``service.destinations.normalise``: scheme and host lower-case, default port dropped,
  empty path ``/``, no fragment).

The ledger may hold other spellings of the same recipient (an address in another case, a
URL written before normalisation existed): :func:`spellings_of` keeps the stored values
whose normalised form is the recipient's, and every statement matches those exactly.
Nothing here logs, and no error quotes the recipient.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, quote_plus, urlsplit

import phonenumbers

from service import destinations, entry, errors

ERASED = "[erased]"  # what replaces a mention in free text

# What may not stand right before or after a mention, or it is a longer, other value:
# joann@example.com is not ann@example.com, +141555501234 is not +14155550123.
_EDGES = {
    "email": (r"(?<![A-Za-z0-9._%+-])", r"(?![A-Za-z0-9_-]|\.[A-Za-z0-9])"),
    "sms": (r"(?<![0-9])", r"(?![0-9])"),
    "webhook": (r"(?<![A-Za-z0-9+.-])", r"(?![A-Za-z0-9/?#%_~+-]|\.[A-Za-z0-9])"),
}


@dataclass(frozen=True)
class Recipient:
    """One recipient, normalised: the channel it is reached on and its address."""

    channel: str  # webhook | email | sms
    address: str  # normalised (see the module's docstring)

    def __repr__(self) -> str:  # never the address, in a traceback or a log
        return f"Recipient({self.channel}, <address hidden>)"

    def normalised(self, stored: str) -> str:
        """A stored destination in the recipient's normal form (for comparing)."""
        if self.channel == "email":
            return stored.lower()
        if self.channel == "webhook":
            return destinations.normalise(stored)
        return stored

    @property
    def prefix(self) -> str:
        """What every stored spelling starts with, lower-cased (the database's first cut:
        the whole address, or a URL's scheme and host)."""
        if self.channel != "webhook":
            return self.address.lower()
        parts = urlsplit(self.address)
        host = parts.hostname or ""
        return f"{parts.scheme}://{'[' if ':' in host else ''}{host}"


def parse(text: str) -> Recipient:
    """The recipient ``text`` names, normalised; ConfigError (exit 2) if it names none."""
    value = text.strip()
    if not value:
        raise errors.ConfigError("--recipient: give an e-mail address, a phone number or a URL")
    if "://" in value:
        return Recipient("webhook", _url(value))
    if "@" in value:
        problem = entry.destination_problem("email", value, ())
        if problem is not None:
            raise errors.ConfigError(f"--recipient: {problem}")
        return Recipient("email", value.lower())
    return Recipient("sms", _number(value))


def _url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise errors.ConfigError("--recipient: a URL must be http(s)://host/...")
    return destinations.normalise(value)


def _number(value: str) -> str:
    problem = (
        "--recipient: not an e-mail address, URL or phone number in international form "
        "('+', country code and number, e.g. +1 415 555 0123)"
    )
    try:
        parsed = phonenumbers.parse(value, None)
    except phonenumbers.NumberParseException:
        raise errors.ConfigError(problem) from None
    if not phonenumbers.is_valid_number(parsed):
        raise errors.ConfigError("--recipient: not a valid phone number (no such number range)")
    return phonenumbers.format_number(parsed, phonenumbers.PhoneNumberFormat.E164)


def spellings_of(recipient: Recipient, stored: Iterable[str]) -> list[str]:
    """The recipient's address and each stored value that is the same recipient."""
    found = {s for s in stored if recipient.normalised(s) == recipient.address}
    return sorted(found | {recipient.address})


def _escaped(literal: str) -> str:
    """``literal`` as a regular expression that PostgreSQL (ARE) and Python read alike:
    every ASCII character but letters and digits escaped."""
    return "".join(f"\\{c}" if c.isascii() and not c.isalnum() else c for c in literal)


def mention_pattern(recipient: Recipient, spellings: Iterable[str]) -> str:
    """A case-insensitive regular expression for each mention of the recipient in free
    text: every spelling as written, percent-encoded (a page's query string) and
    JSON-escaped (a jsonb value read as text), between the channel's edges."""
    forms: set[str] = set()
    for spelling in {*spellings, recipient.address}:
        forms |= {spelling, quote(spelling, safe=""), quote_plus(spelling)}
        forms.add(json.dumps(spelling)[1:-1])
    before, after = _EDGES[recipient.channel]
    alternatives = "|".join(_escaped(f) for f in sorted(forms, key=lambda f: (-len(f), f)))
    return f"{before}(?:{alternatives}){after}"
