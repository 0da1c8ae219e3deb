"""The retention policy as settings give it: periods in order or exit 2 naming both settings,
0 as forever, the cutoffs each period gives, the summary a purge prints, and the refusal of a
backfill that reaches back past what was purged."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from service import errors, retention, settings
from service.retention import Policy, PurgeSummary

NOW = datetime(2026, 12, 2, 3, 17, tzinfo=UTC)


def test_the_defaults_load_in_order_and_give_one_cutoff_per_kind() -> None:
    cutoffs = Policy.from_settings(settings.load()).cutoffs(NOW)
    assert cutoffs.content == {
        "webhook": NOW - timedelta(days=30),
        "email": NOW - timedelta(days=14),
        "sms": NOW - timedelta(days=14),
    }
    assert set(cutoffs.rows.values()) == {NOW - timedelta(days=90)}
    assert (cutoffs.dead_content, cutoffs.dead_rows) == (
        NOW - timedelta(days=90),
        NOW - timedelta(days=180),
    )
    assert (cutoffs.runs, cutoffs.audit) == (NOW - timedelta(days=400),) * 2
    assert cutoffs.events_content == cutoffs.content["webhook"]
    assert cutoffs.rows_horizon() == NOW - timedelta(days=90)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"retention_email_rows_days": 7},
            "RELAY_RETENTION_EMAIL_ROWS_DAYS (7) must be at least "
            "RELAY_RETENTION_EMAIL_CONTENT_DAYS (14) (0 is forever): a row is purged no sooner "
            "than its content",
        ),
        (
            {"retention_dead_content_days": 20},
            "RELAY_RETENTION_DEAD_CONTENT_DAYS (20) must be at least "
            "RELAY_RETENTION_WEBHOOK_CONTENT_DAYS (30) (0 is forever): a dead delivery is kept "
            "at least as long as any other",
        ),
        (
            {"retention_sms_rows_days": 0},  # forever, so the dead rows must be kept forever
            "RELAY_RETENTION_DEAD_ROWS_DAYS (180) must be at least RELAY_RETENTION_SMS_ROWS_DAYS"
            " (0) (0 is forever): a dead delivery is kept at least as long as any other",
        ),
        ({"retention_audit_days": -1}, "RELAY_RETENTION_AUDIT_DAYS: Input should be greater"),
        ({"retention_batch_size": 0}, "RELAY_RETENTION_BATCH_SIZE: Input should be greater"),
        (
            {"retention_purge_rows_per_second": -1},
            "RELAY_RETENTION_PURGE_ROWS_PER_SECOND: Input should be greater than or equal to 0",
        ),
        (
            {"retention_purge_rows_per_second": "fast"},
            "RELAY_RETENTION_PURGE_ROWS_PER_SECOND: Input should be a valid integer",
        ),
    ],
)
def test_a_period_out_of_order_or_out_of_range_is_a_config_error_naming_it(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(errors.ConfigError) as raised:
        settings.load(**overrides)
    assert str(raised.value).startswith(message)


def test_zero_keeps_forever_and_gives_no_cutoff() -> None:
    forever = {
        f"retention_{kind}_{what}_days": 0
        for kind in ("webhook", "email", "sms", "dead")
        for what in ("content", "rows")
    }
    cutoffs = Policy.from_settings(settings.load(**forever, retention_audit_days=0)).cutoffs(NOW)
    assert set(cutoffs.content.values()) == set(cutoffs.rows.values()) == {None}
    assert (cutoffs.dead_content, cutoffs.dead_rows, cutoffs.audit) == (None, None, None)
    assert cutoffs.rows_horizon() is None
    assert cutoffs.runs == NOW - timedelta(days=400)


def test_the_summary_says_what_was_purged_by_table_and_channel_or_nothing() -> None:
    summary = PurgeSummary(False, NOW, {}, 1500, 2.5, run_id=7, status="ok")
    summary.add("content", "deliveries", 3)
    summary.add_channel("content", "email", 3)
    summary.add("rows", "publish_runs", 2)
    assert summary.render() == (
        "purge as of 2026-12-02 03:17:00 UTC (purge run 7): ok\n"
        "  content purged: deliveries 3 (webhook 0, email 3, sms 0)\n"
        "  rows purged: publish_runs 2\n"
        "  pace: at most 1,500 rows/s, paced 2.5 s"
    )
    assert PurgeSummary(False, NOW, {}).render().endswith("\n  pace: unpaced")
    dry = PurgeSummary(True, NOW, {})
    assert dry.render().splitlines()[1:] == [
        "  content would purge: nothing",
        "  rows would purge: nothing",
        "  dry run: nothing changed; run without --dry-run to do it",
    ]
    assert summary.as_dict()["rows"]["publish_runs"] == 2 and summary.total == 5
    assert (summary.as_dict()["rows_per_second"], summary.as_dict()["paced_seconds"]) == (1500, 2.5)


def test_a_backfill_reaching_back_past_the_horizon_is_refused_naming_the_option() -> None:
    horizon = NOW - timedelta(days=90)
    retention.refuse_reaching_back(horizon, horizon, "--from", "x")  # at it: fine
    retention.refuse_reaching_back(NOW - timedelta(days=365), None, "--from", "x")  # no purge yet
    with pytest.raises(errors.ConfigError) as raised:
        retention.refuse_reaching_back(horizon - timedelta(seconds=1), horizon, "--from", "gone")
    assert str(raised.value) == (
        "--from: gone before 2026-09-03 03:17:00 UTC (retention); choose --from at or after it"
    )
