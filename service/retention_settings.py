"""The settings of retention (`relay purge`): how long a final delivery keeps its content
and its row, per destination kind, and how long runs and the audit trail stay. Part of
``service.settings.Settings`` (which inherits them, with the ``RELAY_`` prefix); kept apart
so each settings module stays readable. The defaults and why: README, Configuration, and
docs/operations.md, "How to size retention".

Every period is in days; 0 means keep forever. The rules across settings (a row outlives
its content, a dead delivery outlives a delivered one) are checked at load, and a break
names both settings (exit 2).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

CHANNELS = ("webhook", "email", "sms")


def _days(description: str, default: int) -> Any:
    return Field(default=default, ge=0, le=36500, description=description)


class RetentionSettings(BaseSettings):
    """Retention fields of ``Settings``; environment variable = ``RELAY_`` + field name."""

    retention_webhook_content_days: int = _days(
        "A final webhook delivery's payload and reply excerpts are purged this long after it "
        "ended (ids, state, times, counts and reasons stay) (days; 0: never).",
        30,
    )
    retention_webhook_rows_days: int = _days(
        "A final webhook delivery's row (with its attempts) is deleted this long after it "
        "ended; at least the content period (days; 0: never).",
        90,
    )
    retention_email_content_days: int = _days(
        "A final e-mail delivery's payload, recipient address and reply excerpts are purged "
        "this long after it ended (days; 0: never).",
        14,
    )
    retention_email_rows_days: int = _days(
        "A final e-mail delivery's row (attempts, receipts, reconciliations) is deleted this "
        "long after it ended; at least the content period (days; 0: never).",
        90,
    )
    retention_sms_content_days: int = _days(
        "A final SMS delivery's payload, phone number and reply excerpts are purged this long "
        "after it ended (days; 0: never).",
        14,
    )
    retention_sms_rows_days: int = _days(
        "A final SMS delivery's row (attempts, receipts, reconciliations) is deleted this long "
        "after it ended; at least the content period (days; 0: never).",
        90,
    )
    retention_dead_content_days: int = _days(
        "A dead delivery (replayable until its content is purged) keeps its content this "
        "long, of any kind; at least each kind's content period (days; 0: never).",
        90,
    )
    retention_dead_rows_days: int = _days(
        "A dead delivery's row is deleted this long after it died; at least each kind's "
        "row period and the dead content period (days; 0: never).",
        180,
    )
    retention_runs_days: int = _days(
        "A publish run's record (its counts, and those of its purged rows) is deleted this "
        "long after it finished, once it has no delivery rows left (days; 0: never).",
        400,
    )
    retention_audit_days: int = _days(
        "Operator actions and the audit trail (run and destination actions, replays and "
        "drops, console sessions and reveals, pause windows, lifted suppressions, purge "
        "runs) are deleted this long after they happened (days; 0: never).",
        400,
    )
    retention_batch_size: int = Field(
        default=5000,
        ge=1,
        le=100_000,
        description="Rows `relay purge` changes per transaction (relay purge --batch-size "
        "overrides it): short transactions never hold up the publisher or the consumers.",
    )
    retention_purge_rows_per_second: int = Field(
        default=1500,
        ge=0,
        le=1_000_000,
        description="At most this many rows a second per step of `relay purge` (deliveries, "
        "not counting their attempts; relay purge --rows-per-second overrides it), so a purge "
        "beside a drain costs it little CPU and WAL; 0: as fast as the database goes.",
    )
    retention_purge_yield_seconds: int = Field(
        default=1800,
        ge=0,
        le=86_400,
        description="While deliveries are due and not yet settled (a 06:00 wave, a backlog), "
        "`relay purge` waits between batches, up to this long in all per run, then carries on "
        "at its pace regardless (relay purge --yield-seconds overrides it; s; 0: never waits).",
    )
    retention_purge_period_hours: float = Field(
        default=24.0,
        gt=0,
        description="How often `relay purge` is scheduled (the CronJob runs it daily): "
        "RelayPurgeNotRunning fires when no purge has finished for two of these (h).",
    )

    @model_validator(mode="after")
    def _periods_in_order(self) -> RetentionSettings:
        for longer, shorter, why in _ORDER:
            if _forever(getattr(self, longer)) < _forever(getattr(self, shorter)):
                raise ValueError(
                    f"RELAY_{longer.upper()} ({getattr(self, longer)}) must be at least "
                    f"RELAY_{shorter.upper()} ({getattr(self, shorter)}) (0 is forever): {why}"
                )
        return self


# (longer, shorter, why): a row outlives its content, a dead delivery outlives any other.
_ROW = "a row is purged no sooner than its content"
_DEAD = "a dead delivery is kept at least as long as any other"
_ORDER = (
    *((f"retention_{c}_rows_days", f"retention_{c}_content_days", _ROW) for c in CHANNELS),
    ("retention_dead_rows_days", "retention_dead_content_days", _ROW),
    *(("retention_dead_content_days", f"retention_{c}_content_days", _DEAD) for c in CHANNELS),
    *(("retention_dead_rows_days", f"retention_{c}_rows_days", _DEAD) for c in CHANNELS),
)


def _forever(days: int) -> float:
    return float("inf") if days == 0 else float(days)
