"""What operator commands may print: destinations and text from outside, and progress."""

from __future__ import annotations

import io

from service.ops import deliveries
from service.progress import Progress


def test_a_webhook_destination_is_shown_as_scheme_and_host_only() -> None:
    shown = deliveries.shown_destination("webhook", "https://clinic.example:8443/h/t0k3n?x=1")
    assert shown == "https://clinic.example:8443"


def test_an_email_or_sms_recipient_is_never_shown() -> None:
    assert "@" not in str(deliveries.shown_destination("email", "dr.who@clinic.example"))
    assert "+49" not in str(deliveries.shown_destination("sms", "+4915112345678"))
    assert deliveries.shown_destination("sms", None) is None


def test_text_from_outside_is_redacted_flattened_and_bounded() -> None:
    reply = "unknown user dr.who@clinic.example\n call +4915112345678 or see https://x.example/a "
    cleaned = deliveries.clean(reply + "y" * 500)
    assert cleaned is not None
    assert "dr.who" not in cleaned and "+4915" not in cleaned and "x.example" not in cleaned
    assert "\n" not in cleaned and len(cleaned) == deliveries.EXCERPT_LIMIT
    assert deliveries.clean(None) is None


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_writes_only_to_a_terminal_and_clears_its_line() -> None:
    piped = io.StringIO()
    progress = Progress("load", piped)
    progress.update(10, 20)
    progress.finish()
    assert piped.getvalue() == ""
    tty = _Tty()
    progress = Progress("load", tty, every_seconds=0)
    progress.update(10, 20)
    progress.update(20, 20)
    progress.finish()
    assert "load: 10/20" in tty.getvalue() and "load: 20/20" in tty.getvalue()
    assert tty.getvalue().endswith("\r\x1b[K")
