"""Enabling a destination against real PostgreSQL, RabbitMQ and a real partner receiver:
it resumes only what disabling it paused (never a reminder an operator cancelled), what
fell due meanwhile follows each reminder's missed-fire policy, held deliveries past
stale_after are skipped, and the dry run's counts are what the apply then does."""

from __future__ import annotations

import html
import json
import re
from collections import Counter
from datetime import UTC, datetime, timedelta

import aiohttp
import asyncpg
import pytest

from service.settings import Settings
from tests.support import console as cs
from tests.support import relay as rs
from tests.support.receivers import Receiver, receivers

__all__ = ["receivers"]  # fixture

# Parked deliveries stay parked (their messages cycle through the delay tiers, unclaimable)
# until enable makes them due: the enable, not a re-check, decides what becomes of them.
HOLD = {"destination_hold_seconds": 600.0}
COUNTS = (
    "reminders_resumed", "reminders_cancelled", "held_send", "held_stale", "held_cancelled",
    "occurrences_send", "occurrences_stale", "occurrences_skipped",
)  # fmt: skip


def sent_by_reminder(receiver: Receiver) -> Counter[str]:
    """Requests the partner received, by reminder (the payload says whose)."""
    return Counter(json.loads(r.body)["text"].removeprefix("hello ") for r in receiver.requests)


def daily_two_hours_ago() -> str:
    """A daily time (UTC) whose latest occurrence was about two hours ago: it missed today's
    and the next one is about 22 hours away, beyond the publisher's look-ahead."""
    return f"{datetime.now(UTC) - timedelta(hours=2):%H:%M}"


def readme_dry_run(url: str) -> str:
    """The README's example of `relay destinations enable URL` (a dry run), for ``url``."""
    example = "https://partner.example/hooks/r"
    command = f"$ relay destinations enable {example}\n"
    text = (rs.REPO / "README.md").read_text()
    start = text.index(command) + len(command)
    return text[start : text.index("$ relay", start)].replace(example, url)


async def state_of(pool: asyncpg.Pool, reminder_id: str) -> tuple[bool, str | None]:
    row = await pool.fetchrow(
        "SELECT active, inactive_reason FROM reminders WHERE id = $1", reminder_id
    )
    assert row is not None
    return row["active"], row["inactive_reason"]


async def _held(pool: asyncpg.Pool) -> str:
    """The deliveries not final and their reminders' staleness, as the database sees
    them: one short line each (a long repr is cut off in a failure's report)."""
    rows = await pool.fetch(
        "SELECT d.id, d.reminder_id, d.state::text AS state, d.attempts,"
        " round(extract(epoch FROM now() - d.occurrence_at)::numeric, 1) AS age,"
        " round(extract(epoch FROM d.next_attempt_at - now())::numeric, 1) AS due_in,"
        " extract(epoch FROM r.stale_after) AS stale_after, r.send_stale, r.inactive_reason"
        " FROM deliveries d LEFT JOIN reminders r ON r.id = d.reminder_id"
        " WHERE d.finished_at IS NULL ORDER BY d.id"
    )
    return "\n".join(" ".join(f"{k}={v}" for k, v in r.items()) for r in rows)


async def count(pool: asyncpg.Pool, sql: str, *args: object) -> int:
    return int(await pool.fetchval(sql, *args))


@pytest.mark.timeout(240)
async def test_enable_resumes_what_disable_paused_by_policy_and_never_a_cancelled_reminder(
    settings: Settings, pool: asyncpg.Pool, receivers: list[Receiver]
) -> None:
    settings = settings.model_copy(update=HOLD)
    partner = receivers[0]
    url = partner.url()
    due = datetime.now(UTC)
    daily = daily_two_hours_ago()
    lines = [
        rs.line("held-fresh", url, due_at=due),
        rs.line("held-stale", url, due_at=due, stale_after=3600),
        rs.line("held-cancelled", url, due_at=due),
        rs.line("skipper", url, daily_at=daily, missed_policy="skip"),
        rs.line("latest", url, daily_at=daily, missed_policy="latest"),
        # Its oldest missed occurrence (about 50 h ago) is past stale_after (30 h).
        rs.line("catcher", url, daily_at=daily, missed_policy="catch_up", stale_after=108000),
        rs.line("cancelled", url, daily_at=daily, missed_policy="catch_up"),
    ]
    await rs.load(pool, lines)
    assert (await rs.relay(settings, "reminders", "cancel", "cancelled")).code == 0
    assert (await rs.relay(settings, "publish")).code == 0  # the three one-shots, due now

    off = await rs.relay(settings, "destinations", "disable", url, "--reason", "maintenance",
                         "--json")  # fmt: skip
    assert off.code == 0, off.stderr
    assert json.loads(off.stdout)["reminders_paused"] == 6  # all but the cancelled one
    assert await state_of(pool, "cancelled") == (False, "cancelled")
    assert await state_of(pool, "skipper") == (False, "destination_disabled")

    async with rs.consumer_in_process(settings):

        async def three_held() -> bool:
            sql = "SELECT count(*) FROM deliveries WHERE state = 'retrying' AND attempts = 0"
            return await count(pool, sql) == 3

        await rs.wait_for(three_held, 60, "the three due deliveries held")
        assert partner.requests == []
        # An operator cancels a paused reminder: now it is cancelled, not paused.
        assert (await rs.relay(settings, "reminders", "cancel", "held-cancelled")).code == 0
        assert await state_of(pool, "held-cancelled") == (False, "cancelled")
        # Three days pass while disabled: the daily reminders owe three occurrences each.
        await pool.execute(
            "UPDATE reminders SET next_due_at = next_due_at - interval '3 days'"
            " WHERE schedule_kind = 'daily'"
        )
        assert (await rs.relay(settings, "publish")).code == 0
        assert await count(pool, "SELECT count(*) FROM deliveries") == 3  # paused: none
        # A re-load keeps a paused reminder paused (and its schedule's place) and a
        # cancelled one cancelled; here it also makes the held delivery stale.
        await rs.load(pool, [rs.line("held-stale", url, due_at=due, stale_after=1), lines[-1]])
        assert await state_of(pool, "held-stale") == (False, "destination_disabled")
        stale_now = (
            "SELECT count(*) FROM deliveries d JOIN reminders r ON r.id = d.reminder_id"
            " WHERE r.id = 'held-stale' AND d.state = 'retrying' AND NOT r.send_stale"
            " AND now() - d.occurrence_at > r.stale_after"
        )

        async def held_stale_is_stale() -> bool:
            return await count(pool, stale_now) == 1

        # On a quiet machine everything up to here takes under a second (seen: 0.8 s), so
        # the held delivery becomes stale for its new stale_after (1 s) only now.
        await rs.wait_for(held_stale_is_stale, 30, "the held delivery past its stale_after")
        assert await state_of(pool, "cancelled") == (False, "cancelled")

        said = await rs.relay(settings, "destinations", "enable", url)
        assert said.code == 0 and said.stdout == readme_dry_run(url), said.stdout + await _held(
            pool
        )
        dry = await rs.relay(settings, "destinations", "enable", url, "--json")
        assert dry.code == 0, dry.stderr
        planned = json.loads(dry.stdout)
        assert (planned["apply"], planned["changed"], planned["enabled"]) == (False, True, False)
        expected = {
            "reminders_resumed": 5, "reminders_cancelled": 2,
            "held_send": 1, "held_stale": 1, "held_cancelled": 1,
            # latest: the newest of three; catch_up: all three, the oldest already stale;
            # skip: none (every one is older than the misfire grace)
            "occurrences_send": 3, "occurrences_stale": 1, "occurrences_skipped": 5,
        }  # fmt: skip
        assert {k: planned[k] for k in COUNTS} == expected
        assert await count(pool, "SELECT count(*) FROM destinations WHERE state = 'disabled'") == 1
        assert await count(pool, "SELECT count(*) FROM deliveries WHERE state = 'retrying'") == 3

        on = await rs.relay(settings, "destinations", "enable", url, "--reason", "back",
                            "--apply", "--json")  # fmt: skip
        assert on.code == 0, on.stderr
        applied = json.loads(on.stdout)
        assert applied["enabled"] is True
        assert {k: applied[k] for k in COUNTS} == expected  # the dry run said what it did
        assert await state_of(pool, "cancelled") == (False, "cancelled")
        assert await state_of(pool, "held-cancelled") == (False, "cancelled")
        assert await state_of(pool, "latest") == (True, None)

        assert (await rs.relay(settings, "publish")).code == 0
        run_id = await pool.fetchval("SELECT max(run_id) FROM deliveries")
        admitted = await pool.fetchrow(
            "SELECT count(*) FILTER (WHERE skip_reason IS DISTINCT FROM 'missed') AS owed,"
            " count(*) FILTER (WHERE skip_reason = 'missed') AS missed"
            " FROM deliveries WHERE run_id = $1",
            run_id,
        )
        # Owed: to send, or (the stale one) skipped by the consumer at send time.
        assert tuple(admitted) == (3 + 1, 5)

        async def all_final() -> bool:
            sql = "SELECT count(*) FROM deliveries WHERE state NOT IN ('delivered', 'skipped')"
            return await count(pool, sql) == 0

        await rs.wait_for(all_final, 90, "every delivery final")

    # Final rows are never sent again: this is everything the partner will ever get.
    assert sent_by_reminder(partner) == Counter({"held-fresh": 1, "latest": 1, "catcher": 2})
    skipped = await pool.fetch(
        "SELECT reminder_id, skip_reason, count(*) AS n FROM deliveries"
        " WHERE state = 'skipped' GROUP BY 1, 2 ORDER BY 1, 2"
    )
    assert [(r["reminder_id"], r["skip_reason"], r["n"]) for r in skipped] == [
        ("catcher", "stale", 1),  # admitted by catch_up, skipped by the consumer
        ("held-cancelled", "cancelled", 1),
        ("held-stale", "stale", 1),
        ("latest", "missed", 2),
        ("skipper", "missed", 3),
    ]
    shown = json.loads((await rs.relay(settings, "destinations", "show", url, "--json")).stdout)
    enable, disable = shown["actions"]
    assert (enable["action"], enable["reason"], enable["effect"]) == ("enable", "back", expected)
    assert (disable["action"], disable["effect"]) == ("disable", {"reminders_paused": 6})


async def test_a_reload_revives_a_cancelled_reminder_only_when_its_line_says_active(
    settings: Settings, pool: asyncpg.Pool, receivers: list[Receiver]
) -> None:
    url = receivers[0].url()
    daily = daily_two_hours_ago()
    line = rs.line("r1", url, daily_at=daily)
    await rs.load(pool, [line, rs.line("r2", url, daily_at=daily)])
    assert (await rs.relay(settings, "reminders", "cancel", "r1")).code == 0
    again = await rs.relay(settings, "reminders", "cancel", "r1")
    assert again.code == 1 and "already cancelled" in again.stderr
    await pool.execute("UPDATE reminders SET next_due_at = next_due_at - interval '3 days'")

    await rs.load(pool, [line])  # the same file again: the cancel stands
    assert await state_of(pool, "r1") == (False, "cancelled")
    # A file may cancel on purpose, and revive on purpose.
    await rs.load(pool, [rs.line("r2", url, daily_at=daily, active=False)])
    assert await state_of(pool, "r2") == (False, "cancelled")
    await rs.load(pool, [rs.line("r1", url, daily_at=daily, active=True)])
    assert await state_of(pool, "r1") == (True, None)
    # Revived from now on: no burst of what fell due while it was cancelled.
    next_due = await pool.fetchval("SELECT next_due_at FROM reminders WHERE id = 'r1'")
    assert next_due > datetime.now(UTC)

    # Revived while its destination is disabled, it is paused, not active.
    assert (await rs.relay(settings, "destinations", "disable", url, "--reason", "x")).code == 0
    await rs.load(pool, [rs.line("r2", url, daily_at=daily, active=True)])
    assert await state_of(pool, "r2") == (False, "destination_disabled")
    listed = await rs.relay(settings, "reminders", "list")
    assert "False (destination_disabled)" in listed.stdout


_COUNT = re.compile(r'<td id="([a-z_]+)">(\d+)</td>')


async def _post_page(
    http: aiohttp.ClientSession, url: str, form: dict[str, str], status: int = 200
) -> str:
    async with http.post(url, data=form, allow_redirects=False) as answer:
        text = html.unescape(await answer.text())
        assert answer.status == status, (url, answer.status, text[-500:])
        return text


@pytest.mark.timeout(240)
async def test_the_console_switch_shows_the_dry_run_counts_then_does_what_the_cli_does(
    settings: Settings, pool: asyncpg.Pool, receivers: list[Receiver]
) -> None:
    settings = settings.model_copy(update=HOLD)
    partner = receivers[0]
    url = partner.url()
    mail, letter = "someone@example.com", {"subject": "s", "text": "t"}
    daily = daily_two_hours_ago()
    await rs.load(pool, [
        rs.line("held", url),  # due now
        rs.line("latest", url, daily_at=daily, missed_policy="latest"),
        rs.line("skipper", url, daily_at=daily, missed_policy="skip"),
        rs.line("cancelled", url, daily_at=daily),
        rs.line("mail", mail, channel="email", daily_at=daily, payload=letter),
    ])  # fmt: skip
    assert (await rs.relay(settings, "reminders", "cancel", "cancelled")).code == 0
    assert (await rs.relay(settings, "publish")).code == 0
    ref, mail_ref = await cs.ref_of(pool, url), await cs.ref_of(pool, mail)

    async with cs.console(settings) as c, cs.client() as http:
        csrf = await cs.log_in(http, c.url, "carol")
        # What the CLI refuses, the console refuses, in the same words.
        cli = await rs.relay(settings, "destinations", "disable", mail, "--reason", "x")
        assert cli.code == 2 and "URL refused" in cli.stderr
        refusal = cli.stderr.strip().removeprefix("relay: bad input: ")
        form = {"csrf": csrf, "reason": "x"}
        page = await _post_page(http, f"{c.url}/destinations/{mail_ref}/disable", form, 400)
        assert refusal in page
        assert await count(pool, "SELECT count(*) FROM destinations WHERE url = $1", mail) == 0

        form = {"csrf": csrf, "reason": "clinic closed"}
        page = await _post_page(http, f"{c.url}/destinations/{ref}/disable", form)
        assert "3 reminders paused" in page  # held, latest, skipper: not the cancelled one

        async with rs.consumer_in_process(settings):

            async def held() -> bool:
                sql = "SELECT count(*) FROM deliveries WHERE state = 'retrying'"
                return await count(pool, sql) == 1

            await rs.wait_for(held, 60, "the due delivery held")
            await pool.execute(
                "UPDATE reminders SET next_due_at = next_due_at - interval '3 days'"
                " WHERE schedule_kind = 'daily' AND channel = 'webhook'"
            )

            # The first click is a dry run: the same counts as the CLI's, and nothing changes.
            enable = f"{c.url}/destinations/{ref}/enable"
            page = await _post_page(http, enable, {"csrf": csrf})
            shown = {name: int(n) for name, n in _COUNT.findall(page)}
            cli = await rs.relay(settings, "destinations", "enable", url, "--json")
            assert cli.code == 0, cli.stderr
            expected = {
                "reminders_resumed": 3, "reminders_cancelled": 1,
                "held_send": 1, "held_stale": 0, "held_cancelled": 0,
                "occurrences_send": 1, "occurrences_stale": 0, "occurrences_skipped": 5,
            }  # fmt: skip
            assert shown == {k: json.loads(cli.stdout)[k] for k in COUNTS} == expected
            assert 'name="apply" value="1"' in page
            assert (
                await count(pool, "SELECT count(*) FROM destinations WHERE state = 'disabled'") == 1
            )

            unsaid = await _post_page(http, enable, {"csrf": csrf, "apply": "1"}, 400)
            assert "say why" in unsaid  # as the CLI says without --reason
            form = {"csrf": csrf, "apply": "1", "reason": "clinic open"}
            page = await _post_page(http, enable, form)
            assert "Enabled" in page and {n: int(v) for n, v in _COUNT.findall(page)} == expected
            assert await state_of(pool, "cancelled") == (False, "cancelled")

            assert (await rs.relay(settings, "publish")).code == 0

            async def all_final() -> bool:
                sql = "SELECT count(*) FROM deliveries WHERE state NOT IN ('delivered', 'skipped')"
                return await count(pool, sql) == 0

            await rs.wait_for(all_final, 90, "every delivery final")

    assert sent_by_reminder(partner) == Counter({"held": 1, "latest": 1})
    actions = await pool.fetch(
        "SELECT action, operator, reason, effect FROM destination_actions ORDER BY id"
    )
    assert [(a["action"], a["operator"], a["reason"]) for a in actions] == [
        ("disable", "carol (console)", "clinic closed"),
        ("enable", "carol (console)", "clinic open"),
    ]
    assert actions[1]["effect"] == expected


async def test_a_410_pauses_reminders_as_gone_and_enable_resumes_them_but_not_a_cancelled_one(
    settings: Settings, pool: asyncpg.Pool, receivers: list[Receiver]
) -> None:
    partner = receivers[0]
    partner.status = 410
    url = partner.url()
    daily = daily_two_hours_ago()
    await rs.load(pool, [
        rs.line("now", url),  # due now: its answer is the 410
        rs.line("daily", url, daily_at=daily),
        rs.line("cancelled", url, daily_at=daily),
    ])  # fmt: skip
    assert (await rs.relay(settings, "reminders", "cancel", "cancelled")).code == 0
    assert (await rs.relay(settings, "publish")).code == 0
    async with rs.consumer_in_process(settings):

        async def gone() -> bool:
            return await count(pool, "SELECT count(*) FROM deliveries WHERE state = 'dead'") == 1

        await rs.wait_for(gone, 60, "the 410")
    assert len(partner.requests) == 1
    assert await state_of(pool, "daily") == (False, "gone")
    assert await state_of(pool, "now") == (False, "gone")
    assert await state_of(pool, "cancelled") == (False, "cancelled")
    shown = json.loads((await rs.relay(settings, "destinations", "show", url, "--json")).stdout)
    assert (shown["state"], shown["disabled_reason"]) == ("disabled", "410 gone")

    on = await rs.relay(settings, "destinations", "enable", url, "--reason", "partner is back",
                        "--apply", "--json")  # fmt: skip
    assert on.code == 0, on.stderr
    done = json.loads(on.stdout)
    assert (done["reminders_resumed"], done["reminders_cancelled"]) == (2, 1)
    assert await state_of(pool, "daily") == (True, None)
    assert await state_of(pool, "cancelled") == (False, "cancelled")
