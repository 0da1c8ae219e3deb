"""`relay demo` shows e-mail and SMS as the providers' receipts left them: delivered,
accepted and bounced counted apart, nothing refused, and the addresses the receipts
suppressed."""

from __future__ import annotations

from pathlib import Path

from service.settings import Settings
from tests.support import relay as rs


async def test_the_demo_reports_delivered_accepted_and_bounced_from_real_signed_receipts(
    settings: Settings, tmp_path: Path
) -> None:
    result = await rs.relay(
        settings,
        "demo",
        "--reminders",
        "20",
        "--consumers",
        "1",
        timeout=240,
        STATE_DIR=str(tmp_path),
    )
    assert result.code == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "-- loading 20 webhook, 8 e-mail and 8 SMS reminders due now" in out
    # 8 each: e-mail 3 bounces hard, 6 soft; SMS 1 fails for now, 5 has no handset.
    wait = "accepted 0 (no receipt after 15 min: 0)"
    assert f"email: delivered 6/8 (75.0%), {wait}, bounced 2, skipped 0" in out, out
    assert f"sms: delivered 6/8 (75.0%), {wait}, bounced 2, skipped 0" in out, out
    assert "callbacks relay receipts did not take: 0" in out
    assert "bounced: Permanent/General" in out and "bounced: 30005" in out
    suppressed = out.split("-- suppressed by receipts (relay suppressions list)", 1)[1]
    for address, reason in (
        ("bounce-003@example.com", "hard_bounce"),
        ("complain-004@example.com", "complaint"),
        ("+14155550000", "undeliverable"),
    ):
        assert any(address in line and reason in line for line in suppressed.splitlines())
    assert "softbounce-006" not in suppressed
    receipts_log = next((tmp_path / "demo").glob("*/receipts.log")).read_text()
    assert '"event": "receipt"' in receipts_log and "@" not in receipts_log
