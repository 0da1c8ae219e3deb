"""Suppression: a hard bounce, a complaint or a permanent SMS error puts the address on its
channel's list, and a later send to it is skipped (``suppressed``) at the last check before
the request, never reaching the provider; operators list, add and lift with the CLI and
see the list in the console."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from service.settings import Settings
from tests.support import console as console_support
from tests.support import relay as rs
from tests.support.providers import Providers, providers


def _email(reminder_id: str, address: str) -> str:
    payload = {"subject": f"Report {reminder_id}", "text": "Your daily report"}
    return rs.line(reminder_id, address, channel="email", payload=payload)


def _sms(reminder_id: str, number: str) -> str:
    return rs.line(reminder_id, number, channel="sms", payload={"body": f"Hi {reminder_id}"})


async def _states(pool: asyncpg.Pool) -> dict[str, tuple[str, str | None]]:
    rows = await pool.fetch("SELECT reminder_id, state::text AS s, skip_reason FROM deliveries")
    return {r["reminder_id"]: (r["s"], r["skip_reason"]) for r in rows}


async def _run(
    p: Providers, pool: asyncpg.Pool, lines: list[str], expected: dict[str, Any]
) -> None:
    """Load, publish and consume ``lines`` until the ledger shows ``expected``."""
    await rs.load(pool, lines)
    assert (await rs.relay(p.settings, "publish")).code == 0
    async with rs.consumer_in_process(p.settings):

        async def settled() -> bool:
            states = await _states(pool)
            return {k: states.get(k) for k in expected} == expected

        await rs.wait_for(settled, 60, f"deliveries settled as {expected}")
        await p.email.wait_idle()
        await p.sms.wait_idle()


async def _json(settings: Settings, *args: str) -> Any:
    result = await rs.relay(settings, "suppressions", *args, "--json")
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


async def test_a_hard_bounce_complaint_or_dead_number_suppresses_and_later_sends_are_skipped(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    async with providers(settings) as p:
        await _run(
            p,
            pool,
            [
                _email("hard", "bounce-bob@example.com"),
                _email("soft", "softbounce-cy@example.com"),
                _email("spam", "complain-eve@example.com"),
                _sms("gone", "+14155550000"),
                _sms("flaky", "+14155551111"),
            ],
            {
                "hard": ("bounced", None),
                "soft": ("bounced", None),
                "spam": ("delivered", None),
                "gone": ("bounced", None),
                "flaky": ("bounced", None),
            },
        )
        listed = (await _json(p.settings, "list"))["suppressions"]
        assert sorted((s["channel"], s["address"], s["reason"], s["detail"]) for s in listed) == [
            ("email", "bounce-bob@example.com", "hard_bounce", "Permanent/General"),
            ("email", "complain-eve@example.com", "complaint", "email.complained"),
            ("sms", "+14155550000", "undeliverable", "30005"),
        ]
        sent_before = (len(p.email.emails), len(p.sms.messages))
        # Later sends: the suppressed ones (the address in another case too) are skipped
        # without a request; the soft bounce and the temporary SMS error are sent again.
        await _run(
            p,
            pool,
            [
                _email("hard-2", "Bounce-Bob@Example.com"),
                _email("spam-2", "complain-eve@example.com"),
                _sms("gone-2", "+14155550000"),
                _email("soft-2", "softbounce-cy@example.com"),
                _sms("flaky-2", "+14155551111"),
            ],
            {
                "hard-2": ("skipped", "suppressed"),
                "spam-2": ("skipped", "suppressed"),
                "gone-2": ("skipped", "suppressed"),
                "soft-2": ("bounced", None),
                "flaky-2": ("bounced", None),
            },
        )
        assert (len(p.email.emails), len(p.sms.messages)) == (
            sent_before[0] + 1,
            sent_before[1] + 1,
        )
    skipped = await pool.fetch(
        "SELECT a.outcome, a.error FROM delivery_attempts a JOIN deliveries d"
        " ON d.id = a.delivery_id WHERE d.skip_reason = 'suppressed'"
    )
    assert [(a["outcome"], a["error"]) for a in skipped] == [("skipped", "suppressed")] * 3
    report = json.loads((await rs.relay(p.settings, "status", "--json", "--all-runs")).stdout)
    assert report["runs"][0]["skipped_by_reason"] == {"suppressed": 3}


async def test_operators_add_list_and_lift_suppressions_and_sends_follow(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    added = await _json(settings, "add", "email", "Ann@Example.com", "--reason", "asked us to stop")
    assert (added["address"], added["reason"], added["detail"]) == (
        "ann@example.com",
        "operator",
        "asked us to stop",
    )
    again = await rs.relay(
        settings, "suppressions", "add", "email", "ann@example.com", "--reason", "x"
    )
    assert (again.code, again.stdout.strip()) == (1, "relay: already suppressed on email")
    bad = await rs.relay(settings, "suppressions", "add", "sms", "555-1234", "--reason", "x")
    assert bad.code == 2 and bad.stderr.startswith("relay: bad input: address: not an E.164")
    async with providers(settings) as p:
        await _run(
            p, pool, [_email("first", "ann@example.com")], {"first": ("skipped", "suppressed")}
        )
        assert p.email.emails == []
        lifted = await _json(
            p.settings, "remove", "email", "ANN@example.com", "--reason", "opted in"
        )
        assert (lifted["removed_reason"], lifted["removed_by"] is not None) == ("opted in", True)
        assert (await _json(p.settings, "list"))["suppressions"] == []
        everything = (await _json(p.settings, "list", "--all"))["suppressions"]
        assert [s["removed_reason"] for s in everything] == ["opted in"]
        await _run(p, pool, [_email("second", "ann@example.com")], {"second": ("delivered", None)})
        assert len(p.email.emails) == 1
        text = await rs.relay(p.settings, "suppressions", "list", "--all")
        assert "REMOVED" in text.stdout and "ann@example.com" in text.stdout
        async with (
            console_support.console(p.settings) as c,
            console_support.client() as http,
        ):
            csrf = await console_support.log_in(http, c.url)
            async with http.get(f"{c.url}/suppressions") as page:
                assert page.status == 200
                body = await page.text()
            revealed_form = {"csrf": csrf, "reveal": "1"}
            async with http.post(f"{c.url}/suppressions", data=revealed_form) as page:
                assert page.status == 200
                revealed = await page.text()
    # Redacted as every console page is (by its keyed reference), the address only once
    # revealed, and that reveal recorded in the operator's name.
    assert "ann@example.com" not in body and "(email recipient not shown)" in body
    ref = await console_support.ref_of(pool, "ann@example.com")
    assert ref in body and "lifted" in body and "opted in" in body
    assert "ann@example.com" in revealed and 'id="revealed"' in revealed
    recorded = await pool.fetch("SELECT operator, page FROM console_reveals")
    assert [(r["operator"], r["page"]) for r in recorded] == [("alice (console)", "/suppressions")]
