"""The console in a real browser: Debian's Chromium, headless, driven by Playwright.

From a run with failures: log in, go from the runs page to the run's missing deliveries,
open one, read its attempts, replay it (dry run, then apply with a reason) and watch it
become delivered; a browser without the session, or a request without the CSRF token,
is refused. With RELAY_TEST_SCREENSHOTS set to a folder (docs/console), the main pages
are saved there as PNG files. And markup (a script, an event handler, a javascript: URL, a
closing textarea) in a destination URL (a reminder's and an event subscriber's), a payload,
operator reasons and a partner's reply is shown inert on every page, the event pages too.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest
from playwright.async_api import Browser, ConsoleMessage, Dialog, Page, async_playwright, expect

from service.settings import Settings
from tests.support import console as cs
from tests.support import relay as rs
from tests.support.receivers import keyed
from tests.support.relay import RunningPartner

__all__ = ["keyed"]  # fixtures

CHROMIUM = "/usr/bin/chromium"  # Debian's package: scripts/test installs it when missing


@pytest.fixture
async def browser() -> Browser:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} missing: install Debian's chromium package (as root: apt-get install"
            " chromium; scripts/test does it when run as root)"
        )
    async with async_playwright() as p:
        launched = await p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield launched  # type: ignore[misc]
        finally:
            await launched.close()


class Shots:
    """Screenshots of the pages, kept in RELAY_TEST_SCREENSHOTS when it names a folder."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        target = os.environ.get("RELAY_TEST_SCREENSHOTS")
        self.keep = Path(target) if target else None

    async def take(self, page: Page, name: str) -> None:
        path = self.scratch / f"{name}.png"
        await page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 0
        if self.keep is not None:
            self.keep.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, self.keep / path.name)


async def _log_in(page: Page, url: str) -> None:
    await page.goto(f"{url}/runs")
    await expect(page).to_have_url(f"{url}/login")  # no session: the login page
    await page.fill("input[name=name]", "alice")
    await page.fill("input[name=token]", cs.TOKEN)
    await page.click("button[type=submit]")
    await expect(page).to_have_url(f"{url}/runs")


async def _to_the_dead_delivery(page: Page, shots: Shots, failed: cs.Failures) -> None:
    """Runs page -> the run's missing deliveries -> the first dead one and its attempts."""
    await expect(page.locator(f"#run-{failed.run_id}")).to_be_visible()
    await shots.take(page, "runs")
    await page.click(f"#run-{failed.run_id}")
    await expect(page).to_have_title(f"Run {failed.run_id} — relay console")
    await expect(page.locator("#missing tbody tr")).to_have_count(len(failed.dead))
    await shots.take(page, "run-missing")
    await page.click(f"#delivery-{failed.dead[0]}")
    await expect(page.locator("#delivery-state")).to_have_text("dead")
    attempts = page.locator("#attempts tbody tr")
    await expect(attempts).to_have_count(1)
    await expect(attempts.first).to_contain_text("rejected")
    await expect(attempts.first).to_contain_text("400")
    await shots.take(page, "delivery")


async def _replay_until_delivered(page: Page, shots: Shots, fixed: Callable[[], object]) -> None:
    """Dry run, then (the receiver fixed) apply with a reason, then watch it delivered."""
    await page.click("#replay-dry-run")
    await expect(page.locator("#replay-summary")).to_contain_text("Would replay 1")
    await shots.take(page, "replay-dry-run")
    fixed()
    await page.fill("#replay-reason", "receiver fixed (INC-7)")
    await page.click("#replay-apply")
    await expect(page.locator("#replay-summary")).to_contain_text("Replayed 1")
    await page.click("#back")
    for _ in range(100):
        if await page.locator("#delivery-state").inner_text() == "delivered":
            break
        await page.wait_for_timeout(200)
        await page.reload()
    await expect(page.locator("#delivery-state")).to_have_text("delivered")
    attempts = page.locator("#attempts tbody tr")
    await expect(attempts).to_have_count(2)
    await expect(attempts.nth(1)).to_contain_text("accepted")
    await shots.take(page, "delivery-replayed")


async def _refusals(browser: Browser, page: Page, url: str, run_id: int) -> None:
    """The session's page may not post without its CSRF token, and a browser without the
    session may not act at all."""
    form = {"run_id": str(run_id), "apply": "1", "reason": "forged"}
    refused = await page.request.post(f"{url}/replay", form=form)
    assert refused.status == 403
    stranger = await browser.new_context()
    try:
        anonymous = await stranger.request.post(f"{url}/replay", form=form)
        assert anonymous.status == 401
    finally:
        await stranger.close()


async def test_in_a_browser_a_missing_delivery_is_found_replayed_and_delivered(
    settings: Settings,
    pool: asyncpg.Pool,
    partner: RunningPartner,
    browser: Browser,
    tmp_path: Path,
) -> None:
    shots = Shots(tmp_path)
    async with rs.consumer_in_process(settings):
        failed = await cs.run_with_failures(settings, pool, partner)
        async with cs.console(settings) as c:
            page = await browser.new_page(viewport={"width": 1280, "height": 720})
            await _log_in(page, c.url)
            await _to_the_dead_delivery(page, shots, failed)
            assert await rs.states(pool) == {"delivered": 3, "dead": 2}
            await _replay_until_delivered(
                page,
                shots,
                lambda: partner.state.rules.pop("bad"),  # the receiver is fixed
            )
            await page.goto(f"{c.url}/dead")
            await expect(page.locator("#replays tbody tr")).to_have_count(1)
            await expect(page.locator("#replays")).to_contain_text("alice (console)")
            await shots.take(page, "dead")
            await page.goto(f"{c.url}/destinations")
            await expect(page.locator("#destinations tbody tr")).to_have_count(2)
            await shots.take(page, "destinations")
            await _refusals(browser, page, c.url, failed.run_id)
    states = dict(await pool.fetch("SELECT id, state::text FROM deliveries"))
    assert states[failed.dead[0]] == "delivered" and states[failed.dead[1]] == "dead"


# Markup where text belongs: a script, an attribute break-out with an event handler, a
# javascript: URL and a closing textarea. No whitespace, so it also fits in a URL.
NASTY = (
    '<script>alert("xss-script")</script>"><img/src=x/onerror=alert("xss-img")>'
    'javascript:alert("xss-js")</textarea>'
)


async def _nasty_ledger(settings: Settings, pool: asyncpg.Pool, base: str) -> dict[str, int]:
    """A dead delivery to a URL full of markup, one whose partner answered markup (both
    with a markup payload), then a replay, a hold and a disable whose reasons are markup."""
    payload = {"text": NASTY}
    await rs.load(
        pool,
        [
            rs.line("xss-url", f"{base}/hooks/{NASTY}", payload=payload),
            rs.line("xss-body", f"{base}/hooks/plain", payload=payload),
        ],
    )
    assert (await rs.relay(settings, "publish")).code == 0
    sql = "SELECT reminder_id, id FROM deliveries WHERE state = 'dead'"

    async def both_dead() -> bool:
        return len(await pool.fetch(sql)) == 2

    await rs.wait_for(both_dead, 60, "both deliveries dead")
    ids = {r["reminder_id"]: r["id"] for r in await pool.fetch(sql)}
    ids["run"] = await pool.fetchval("SELECT run_id FROM deliveries WHERE id = $1", ids["xss-body"])
    return ids


async def _act_with_nasty_reasons(
    base: str, receiver: str, pool: asyncpg.Pool, ids: dict[str, int]
) -> None:
    """Replay, hold and disable, each with markup for a reason."""
    ref = await cs.ref_of(pool, f"{receiver}/hooks/plain")
    async with cs.client(headers=cs.bearer("erin")) as http:
        calls = [
            ("/api/v1/replay", {"delivery_id": ids["xss-body"], "apply": True}),
            (f"/api/v1/runs/{ids['run']}/hold", {"apply": True}),
            (f"/api/v1/destinations/{ref}/disable", {}),
        ]
        for path, body in calls:
            async with http.post(base + path, json=body | {"reason": NASTY}) as answer:
                assert answer.status == 200, (path, await answer.text())


async def _inert(page: Page, fired: list[str], blocked: list[str], visible: list[str]) -> None:
    """Nothing ran and nothing was made of the markup; ``visible`` is shown as text."""
    await expect(page.locator("main")).to_be_visible()
    assert fired == [] and blocked == [], (page.url, fired, blocked)
    injected = "main script, main img, main textarea, main iframe, a[href^='javascript:']"
    assert await page.locator(injected).count() == 0, page.url
    for text in visible:
        await expect(page.locator("main")).to_contain_text(text)


def _watch(page: Page) -> tuple[list[str], list[str]]:
    """Every dialog (dismissed) and every script the page's CSP blocked, from now on."""
    fired: list[str] = []
    blocked: list[str] = []

    async def on_dialog(dialog: Dialog) -> None:
        fired.append(dialog.message)
        await dialog.dismiss()

    def on_console(message: ConsoleMessage) -> None:
        if "Content Security Policy" in message.text:
            blocked.append(message.text)

    page.on("dialog", on_dialog)
    page.on("console", on_console)
    return fired, blocked


async def test_markup_in_urls_payloads_reasons_and_replies_is_shown_inert_on_every_page(
    keyed: Settings, pool: asyncpg.Pool, browser: Browser
) -> None:
    """A destination URL, a payload, operator reasons (a suppression's too) and a partner's
    reply full of markup: on every page (redacted and revealed) no dialog fires, no element
    is made of it, and what the page shows of it reads as text. (The payload is never read
    by the console.)"""
    async with cs.answering(NASTY) as receiver:
        nasty_url = f"{receiver}/hooks/{NASTY}"
        event_url = f"{receiver}/events/{NASTY}"
        async with rs.consumer_in_process(keyed):
            ids = await _nasty_ledger(keyed, pool, receiver)
            event = await cs.dead_event(keyed, pool, "xss:1", event_url, {"text": NASTY})
        suppressed = "nasty@example.com"  # an operator's suppression, markup for its reason
        added = await rs.relay(keyed, "suppressions", "add", "email", suppressed, "--reason", NASTY)
        assert added.code == 0, added.stderr
        async with cs.console(keyed) as c:
            await _act_with_nasty_reasons(c.url, receiver, pool, ids)
            page = await browser.new_page(viewport={"width": 1280, "height": 720})
            fired, blocked = _watch(page)
            await _log_in(page, c.url)
            # (page, shown as text when redacted, shown as text once revealed)
            plan = [
                ("/runs", [], []),
                (f"/runs/{ids['run']}", [NASTY], [nasty_url]),  # the hold's reason
                (f"/deliveries/{ids['xss-body']}", [NASTY], []),  # the partner's reply
                ("/dead", [], []),
                ("/destinations", [NASTY], [nasty_url]),  # the disable's reason
                ("/suppressions", [NASTY], [suppressed]),  # the operator's why, the address
                ("/events", [], []),
                (f"/events/{event.event_id}", [], [event_url]),
                (f"/deliveries/{event.delivery_id}", [NASTY], [event_url]),
                (f"/deliveries/{ids['xss-url']}", [NASTY], [nasty_url]),  # last: its replay
            ]
            unrevealing = ("/runs", "/events")  # lists without recipients or replies
            for path, visible, revealed in plan:
                await page.goto(c.url + path)
                await _inert(page, fired, blocked, visible)
                if path not in unrevealing:
                    await page.click("#reveal")
                    await expect(page.locator("#revealed")).to_be_visible()
                    await _inert(page, fired, blocked, visible + revealed)
            await page.click("#replay-dry-run")  # the dead one's replay page
            await expect(page.locator("#replay-summary")).to_contain_text("Would replay 1")
            await _inert(page, fired, blocked, [])
    revealed_pages = await pool.fetchval("SELECT count(*) FROM console_reveals")
    assert revealed_pages == len(plan) - len(unrevealing)
