"""A run's completion: the report counts every owed row, the alert's gauge leaves out the
rows skipped on purpose, so a paused or cancelled run does not page anyone."""

from __future__ import annotations

from datetime import UTC, datetime

from service.runs import RunReport


def _run(**states: int) -> RunReport:
    at = datetime(2026, 12, 1, 6, 0, tzinfo=UTC)
    return RunReport(
        run_id=1, kind="publish", status="ok", intended_fire_at=at, started_at=at,
        finished_at=at, lag_seconds=0.0, due=0, created=sum(states.values()), published=0,
        rescued=0, failed_to_publish=0, states=states,
    )  # fmt: skip


def test_skips_are_incomplete_in_the_report_but_not_for_the_alert() -> None:
    run = _run(delivered=8, skipped=2)
    assert run.completion_ratio == 0.8
    assert run.sendable_completion_ratio == 1.0


def test_dead_and_open_rows_count_against_both() -> None:
    run = _run(delivered=6, dead=1, queued=1, skipped=2)
    assert run.completion_ratio == 0.6
    assert run.sendable_completion_ratio == 0.75


def test_a_run_skipped_entirely_has_nothing_to_send() -> None:
    run = _run(skipped=5)
    assert run.completion_ratio == 0.0
    assert run.sendable_completion_ratio is None
    assert _run().completion_ratio is None and _run().sendable_completion_ratio is None
