"""The console in a real browser: Debian's Chromium, headless, driven by Playwright.

From a run with failures: log in, go from the runs page to the run's missing deliveries,
open one, read its attempts, replay it (dry run, then apply with a reason) and watch it
become delivered; a browser without the session, or a request without the CSRF token,
is refused. With RELAY_TEST_SCREENSHOTS set to a folder (docs/console), the main pages
are saved there as PNG files.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from service.settings import Settings
from tests.support import console as cs
from tests.support import relay as rs
from tests.support.relay import RunningPartner

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
