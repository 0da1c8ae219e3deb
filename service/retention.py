"""Retention: what ``relay purge`` may remove and when (the policy, from the
``RELAY_RETENTION_*`` settings), what one purge did (``PurgeSummary``), and the reads other
parts need: how far back purges have reached (backfills refuse to reach past it) and the
facts the consumer's gauges report (oldest final row kept, last purge, rows purged).

The purge itself is ``service.ledger.purge.purge``. Every period counts back from one instant, the
purge's ``as_of`` (the database's clock, or a test's or benchmark's simulated time), and is
measured from when a row became final (``finished_at``: a delivery's outcome, a run's end)
or when a record was written (events, operator actions). A period of 0 days is forever: no
cutoff, nothing of that kind is removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from service import errors, ledger
from service.db import q
from service.retention_settings import CHANNELS, RetentionSettings

# The tables a purge changes, in the order it reports them.
DELIVERY_CHILDREN = ("delivery_attempts", "receipts", "reconciliations")
AUDIT_TABLES = (
    "run_actions",
    "destination_actions",
    "replays",
    "console_reveals",
    "console_sessions",
    "admission_pauses",
    "suppressions",
    "purge_runs",
)
CONTENT_TABLES = ("deliveries", "delivery_attempts", "events")
ROW_TABLES = ("deliveries", *DELIVERY_CHILDREN, "events", "publish_runs", *AUDIT_TABLES)


@dataclass(frozen=True)
class Cutoffs:
    """The instants before which each kind of record goes (None: never)."""

    content: Mapping[str, datetime | None]  # channel -> a final delivery's content
    rows: Mapping[str, datetime | None]  # channel -> a final delivery's row
    dead_content: datetime | None
    dead_rows: datetime | None
    runs: datetime | None
    audit: datetime | None

    @property
    def events_content(self) -> datetime | None:
        """An event's payload: with its deliveries' content (events reach webhooks only)."""
        return self.content["webhook"]

    @property
    def events_rows(self) -> datetime | None:
        return self.rows["webhook"]

    def rows_horizon(self) -> datetime | None:
        """The latest row cutoff: no delivery row that ended after it is ever deleted."""
        found = [c for c in self.rows.values() if c is not None]
        return max(found) if found else None


@dataclass(frozen=True)
class Policy:
    """How long each kind of record is kept, in days (0: forever)."""

    content_days: Mapping[str, int]
    rows_days: Mapping[str, int]
    dead_content_days: int
    dead_rows_days: int
    runs_days: int
    audit_days: int

    @classmethod
    def from_settings(cls, settings: RetentionSettings) -> Policy:
        return cls(
            content_days={c: getattr(settings, f"retention_{c}_content_days") for c in CHANNELS},
            rows_days={c: getattr(settings, f"retention_{c}_rows_days") for c in CHANNELS},
            dead_content_days=settings.retention_dead_content_days,
            dead_rows_days=settings.retention_dead_rows_days,
            runs_days=settings.retention_runs_days,
            audit_days=settings.retention_audit_days,
        )

    def cutoffs(self, as_of: datetime) -> Cutoffs:
        def before(days: int) -> datetime | None:
            return None if days == 0 else as_of - timedelta(days=days)

        return Cutoffs(
            content={c: before(d) for c, d in self.content_days.items()},
            rows={c: before(d) for c, d in self.rows_days.items()},
            dead_content=before(self.dead_content_days),
            dead_rows=before(self.dead_rows_days),
            runs=before(self.runs_days),
            audit=before(self.audit_days),
        )

    def as_dict(self) -> dict[str, Any]:
        """The policy as recorded with a purge run and printed by ``--json`` (days)."""
        return {
            "content_days": dict(self.content_days),
            "rows_days": dict(self.rows_days),
            "dead_content_days": self.dead_content_days,
            "dead_rows_days": self.dead_rows_days,
            "runs_days": self.runs_days,
            "audit_days": self.audit_days,
        }


@dataclass
class PurgeSummary:
    """What one purge removed (a dry run: would remove), by table."""

    dry_run: bool
    as_of: datetime
    policy: dict[str, Any]
    rows_per_second: int = 0  # the cap in force (0: unpaced, as a dry run always is)
    paced_seconds: float = 0.0  # slept to keep within it
    yield_seconds: int = 0  # the most it may wait for due deliveries (0: never waits)
    yielded_seconds: float = 0.0  # waited for them
    run_id: int | None = None  # the purge_runs row (None for a dry run)
    status: str = "running"  # ok when every step ran to its end
    batches: int = 0
    # table -> rows whose content was purged (deliveries, delivery_attempts' excerpts, events)
    content: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CONTENT_TABLES, 0))
    # table -> rows deleted
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROW_TABLES, 0))
    # "content" / "rows" -> channel -> deliveries
    by_channel: dict[str, dict[str, int]] = field(
        default_factory=lambda: {"content": {}, "rows": {}}
    )

    def add(self, kind: str, table: str, n: int) -> None:
        counts = self.content if kind == "content" else self.rows
        counts[table] = counts.get(table, 0) + n

    def add_channel(self, kind: str, channel: str, n: int) -> None:
        counts = self.by_channel[kind]
        counts[channel] = counts.get(channel, 0) + n

    @property
    def total(self) -> int:
        return sum(self.content.values()) + sum(self.rows.values())

    def pace(self) -> str:
        """The cap in force and the time paced so far, for the progress line and summary."""
        pace = "unpaced"
        if self.rows_per_second:
            pace = f"at most {self.rows_per_second:,} rows/s, paced {self.paced_seconds:.1f} s"
        if self.yield_seconds:
            pace += (
                f"; waited {self.yielded_seconds:.0f} s (of at most {self.yield_seconds:,})"
                " for due deliveries"
            )
        return pace

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "as_of": self.as_of,
            "purge_run_id": self.run_id,
            "status": self.status,
            "batches": self.batches,
            "rows_per_second": self.rows_per_second,
            "paced_seconds": round(self.paced_seconds, 3),
            "yield_seconds": self.yield_seconds,
            "yielded_seconds": round(self.yielded_seconds, 3),
            "policy": self.policy,
            "content": dict(self.content),
            "rows": dict(self.rows),
            "deliveries_by_channel": {k: dict(v) for k, v in self.by_channel.items()},
        }

    def render(self) -> str:
        """The summary line(s) ``relay purge`` prints."""
        verb = "would purge" if self.dry_run else "purged"
        head = f"purge as of {self.as_of:%Y-%m-%d %H:%M:%S} UTC"
        head += ": dry run" if self.dry_run else f" (purge run {self.run_id}): {self.status}"
        lines = [head]
        lines.append(f"  content {verb}: " + _counts(self.content, self.by_channel["content"]))
        lines.append(f"  rows {verb}: " + _counts(self.rows, self.by_channel["rows"]))
        if self.dry_run:
            lines.append("  dry run: nothing changed; run without --dry-run to do it")
        else:
            lines.append(f"  pace: {self.pace()}")
        return "\n".join(lines)


def _counts(tables: Mapping[str, int], channels: Mapping[str, int]) -> str:
    parts = []
    for table, n in tables.items():
        if not n:
            continue
        text = f"{table} {n}"
        if table == "deliveries" and any(channels.values()):
            text += " (" + ", ".join(f"{c} {channels.get(c, 0)}" for c in CHANNELS) + ")"
        parts.append(text)
    return ", ".join(parts) or "nothing"


# --- reads other parts share ------------------------------------------------------------


@dataclass(frozen=True)
class Horizon:
    """How far back purges have reached (None: not yet)."""

    rows_purged_before: datetime | None
    event_content_purged_before: datetime | None


async def horizon(executor: ledger.Executor) -> Horizon:
    """Nothing that ended before ``rows_purged_before`` may still have its delivery row;
    no event created before ``event_content_purged_before`` its payload."""
    row = await executor.fetchrow(q("retention_horizon"))
    if row is None:
        return Horizon(None, None)
    return Horizon(row["rows_purged_before"], row["event_content_purged_before"])


def refuse_reaching_back(since: datetime, before: datetime | None, option: str, what: str) -> None:
    """Raise ConfigError (exit 2) if a backfill from ``since`` reaches back past a purge
    horizon ``before``: what it would find missing there may have been purged, not owed."""
    if before is not None and since < before:
        raise errors.ConfigError(
            f"{option}: {what} before {before:%Y-%m-%d %H:%M:%S} UTC (retention); "
            f"choose {option} at or after it"
        )


@dataclass(frozen=True)
class Facts:
    """What the consumer's gauges report about retention, read from the ledger."""

    # When the newest purge run finished whole (Unix time); before the first, when
    # retention was installed (migration 0018), so a purge that never runs still alerts.
    last_purge_finished: float | None
    # channel -> seconds since the oldest final delivery still kept ended (no entry: none)
    oldest_final_seconds: dict[str, float]
    # channel -> seconds since the oldest final delivery still holding its content ended
    oldest_content_seconds: dict[str, float]
    # "table/kind" -> rows every purge ever removed (a counter that only grows)
    purged_totals: dict[str, int]


async def facts(executor: ledger.Executor) -> Facts:
    """The retention facts, a few index reads (the sampler runs this every 15 s)."""
    last = await executor.fetchval(q("retention_last_purge"))
    oldest = await executor.fetch(q("retention_oldest_final"))
    totals = await executor.fetch(q("retention_purge_totals"))
    return Facts(
        last_purge_finished=None if last is None else last.timestamp(),
        oldest_final_seconds={
            r["channel"]: r["final_seconds"] for r in oldest if r["final_seconds"] is not None
        },
        oldest_content_seconds={
            r["channel"]: r["content_seconds"] for r in oldest if r["content_seconds"] is not None
        },
        purged_totals={f"{r['table_name']}/{r['kind']}": r["rows"] for r in totals},
    )
