"""Publish runs and the admission switch: the one door to ``publish_runs`` and
``admission``.

A run is recorded when it starts (``running``) and finished once with its counts; the
CHECK constraint ties ``finished_at`` to the status, and finishing a run that is no
longer ``running`` changes nothing. The run report (what a run was due, what became
of its deliveries, its lag) is read here too, because both ``relay status`` and the
consumer's metrics sampler need it. Each function runs named blocks of
``sql/queries.sql``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from service import db, ledger, receipts


@dataclass(frozen=True)
class Started:
    """A run just recorded as ``running``."""

    run_id: int
    started_at: datetime  # the database's clock


@dataclass
class RunReport:
    """One run as ``relay status`` and the metrics sampler see it."""

    run_id: int
    kind: str
    status: str
    intended_fire_at: datetime
    started_at: datetime
    finished_at: datetime | None
    lag_seconds: float
    due: int
    created: int
    published: int
    rescued: int
    failed_to_publish: int
    states: dict[str, int] = field(default_factory=dict)  # ledger state -> rows of this run
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    oldest_pending_seconds: float | None = None
    # From due to accepted, over the run's delivered rows (None until one is delivered).
    lateness_p50_seconds: float | None = None
    lateness_p95_seconds: float | None = None
    lateness_max_seconds: float | None = None

    # channel -> ledger state -> rows of this run
    channels: dict[str, dict[str, int]] = field(default_factory=dict)
    held_at: datetime | None = None
    # e-mail, SMS: channel -> rows accepted longer than RELAY_RECEIPT_WAIT_SECONDS ago that
    # no receipt settled ("accepted, no receipt after N minutes")
    no_receipt: dict[str, int] = field(default_factory=dict)
    # Retention: rows of this run whose content was purged (still counted and listed), and
    # rows purged whole (counted from the run's record, in the counts above; no longer
    # listed), of which not delivered.
    content_purged: int = 0
    rows_purged: int = 0
    rows_purged_missing: int = 0

    @property
    def delivered(self) -> int:
        return self.states.get(ledger.State.DELIVERED, 0)

    @property
    def owed(self) -> int:
        """Every occurrence the run admitted: sent, to be sent, dead or skipped."""
        return sum(self.states.values())

    @property
    def completion_ratio(self) -> float | None:
        """Delivered over owed: a skipped or dead delivery is not complete (someone did
        not get it), and is shown beside the ratio."""
        return completion(self.states)

    @property
    def sendable_completion_ratio(self) -> float | None:
        """Delivered over the rows meant to be sent (owed minus deliberate skips: paused,
        cancelled, stale). What the completion alert watches: a run skipped on purpose
        must not page anyone, a dead or undelivered row must. None when nothing is sendable."""
        sendable = self.owed - self.states.get(ledger.State.SKIPPED, 0)
        return None if sendable == 0 else self.delivered / sendable

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["delivered"] = self.delivered
        data["owed"] = self.owed
        data["completion_ratio"] = self.completion_ratio
        data["by_channel"] = {
            channel: summary(states, self.no_receipt.get(channel, 0), channel)
            for channel, states in sorted(self.channels.items())
        }
        del data["channels"], data["no_receipt"]
        return data


def completion(states: dict[str, int]) -> float | None:
    """Delivered over owed (None when nothing is owed)."""
    total = sum(states.values())
    return None if total == 0 else states.get(ledger.State.DELIVERED, 0) / total


def summary(states: dict[str, int], no_receipt: int = 0, channel: str = "") -> dict[str, Any]:
    """owed, delivered, skipped, dead, pending (not final) and the completion ratio; for a
    channel with receipts also accepted (no receipt yet), of those ``no_receipt`` (past
    the wait), and bounced, none of which is delivered."""
    counts = {
        "owed": sum(states.values()),
        "delivered": states.get(ledger.State.DELIVERED, 0),
        "skipped": states.get(ledger.State.SKIPPED, 0),
        "dead": states.get(ledger.State.DEAD, 0),
        "pending": sum(states.get(s, 0) for s in ledger.OPEN_STATES),
        "completion_ratio": completion(states),
    }
    if receipts.waits_for_receipt(channel):
        counts["accepted"] = states.get(ledger.State.ACCEPTED, 0)
        counts["no_receipt"] = no_receipt
        counts["bounced"] = states.get(ledger.State.BOUNCED, 0)
    return counts


async def start(
    executor: ledger.Executor, kind: str, intended_fire_at: datetime, host: str
) -> Started:
    """Record a new ``running`` run of ``kind`` (``publish`` or ``rescue``)."""
    row = await executor.fetchrow(db.q("start_run"), kind, intended_fire_at, host)
    assert row is not None  # an INSERT ... RETURNING always returns its row
    return Started(run_id=row["id"], started_at=row["started_at"])


async def finish(
    executor: ledger.Executor,
    run_id: int,
    status: str,
    *,
    due: int,
    created: int,
    skipped: int,
    published: int,
    rescued: int,
    failed: int,
    error: str | None,
) -> bool:
    """running -> ``status`` with the run's counts; False if it was already finished."""
    result = await executor.execute(
        db.q("finish_run"),
        run_id,
        status,
        due,
        created,
        skipped,
        published,
        rescued,
        failed,
        error,
    )
    return result == "UPDATE 1"


async def record_published(
    executor: ledger.Executor, run_id: int, published: int, failed: int
) -> None:
    """A finished run that published afterwards (a backfill with --publish): its counts."""
    await executor.execute(db.q("run_published_count"), run_id, published, failed)


async def admission_paused(executor: ledger.Executor) -> bool:
    """Whether ``relay pause`` stopped the admission of scheduled occurrences."""
    return bool(await executor.fetchval(db.q("admission_paused")))


async def set_admission_paused(conn: ledger.Connection, paused: bool, changed_by: str) -> bool:
    """Pause or resume admission, recording who did it and the window it opens or closes
    (occurrences due inside a window are skipped 'paused'); returns the new setting."""
    async with conn.transaction():
        result = bool(await conn.fetchval(db.q("set_admission"), paused, changed_by))
        if paused:
            await conn.execute(db.q("admission_pause_open"), changed_by)
        else:
            await conn.execute(db.q("admission_pause_close"), changed_by)
    return result


async def pause_windows(
    executor: ledger.Executor, since: datetime
) -> list[tuple[datetime, datetime]]:
    """The windows (start, end) admission was paused that reach past ``since``; an open
    one ends at infinity."""
    rows = await executor.fetch(db.q("admission_pause_windows"), since)
    return [(r["paused_at"], r["resumed_at"]) for r in rows]


def in_pause(at: datetime, windows: Sequence[tuple[datetime, datetime]]) -> bool:
    """Whether an occurrence due at ``at`` fell inside a window admission was paused (it
    is then skipped 'paused', whatever the missed-fire policy says)."""
    return any(start <= at < end for start, end in windows)


async def latest_with_work(executor: ledger.Executor) -> int | None:
    """The latest publish run that admitted anything (not the empty runs after it)."""
    run_id: int | None = await executor.fetchval(db.q("latest_publish_run"))
    return run_id


@dataclass(frozen=True)
class Newest:
    """The newest publish run, whether or not it admitted anything."""

    started_at: datetime  # the database's clock
    # Its start minus its intended fire time: the oldest due occurrence it found, or its own
    # start when nothing was due (then about 0: nothing waited for it).
    lag_seconds: float


async def newest_publish_run(executor: ledger.Executor) -> Newest | None:
    """The newest run of kind ``publish`` (empty ones included); None before the first."""
    row = await executor.fetchrow(db.q("newest_publish_run"))
    if row is None:
        return None
    lag = (row["started_at"] - row["intended_fire_at"]).total_seconds()
    return Newest(started_at=row["started_at"], lag_seconds=lag)


async def reports(
    executor: ledger.Executor,
    run_id: int | None,
    count: int,
    now: datetime,
    kind: str | None = None,
    *,
    nonempty: bool = False,
    receipt_wait_seconds: float = 900.0,
) -> list[RunReport]:
    """Reports of recent runs, newest first (``nonempty``: only runs that admitted work).

    ``now`` is the database's clock, for the age of the oldest pending row; an e-mail or
    SMS accepted longer than ``receipt_wait_seconds`` ago without a receipt is counted as
    having none.
    """
    found, purged = await _recent(executor, run_id, count, kind, nonempty)
    await _count_states(executor, found, now)
    for run, counts in purged.items():
        add_purged(found[run], counts)
    overdue = await receipts.overdue_by_run(executor, list(found), receipt_wait_seconds)
    for run, by_channel in overdue.items():
        found[run].no_receipt = by_channel
    for row in await executor.fetch(db.q("run_lateness"), list(found)):
        report = found[row["run_id"]]
        report.lateness_p50_seconds = row["p50"]
        report.lateness_p95_seconds = row["p95"]
        report.lateness_max_seconds = row["max"]
    return list(found.values())


async def _recent(
    executor: ledger.Executor, run_id: int | None, count: int, kind: str | None, nonempty: bool
) -> tuple[dict[int, RunReport], dict[int, dict[str, int]]]:
    """The runs themselves, by id, without their deliveries' states yet; and the counts of
    their rows retention purged ('channel/state/skip reason' -> rows)."""
    rows = await executor.fetch(db.q("runs_recent"), run_id, count, kind, nonempty)
    purged = {r["id"]: r["purged_counts"] for r in rows if r["purged_counts"]}
    return {
        r["id"]: RunReport(
            run_id=r["id"],
            kind=r["kind"],
            status=r["status"],
            intended_fire_at=r["intended_fire_at"],
            started_at=r["started_at"],
            finished_at=r["finished_at"],
            lag_seconds=(r["started_at"] - r["intended_fire_at"]).total_seconds(),
            due=r["due_count"],
            created=r["created_count"],
            published=r["published_count"],
            rescued=r["rescued_count"],
            failed_to_publish=r["failed_count"],
            held_at=r["held_at"],
        )
        for r in rows
    }, purged


def add_purged(report: RunReport, counts: dict[str, int]) -> None:
    """Count the run's rows that retention purged as if they were still there (their
    states, skip reasons and channels were recorded before they went)."""
    for key, n in counts.items():
        channel, state, reason = key.split("/", 2)
        report.states[state] = report.states.get(state, 0) + n
        if state == ledger.State.SKIPPED:
            report.skipped_by_reason[reason] = report.skipped_by_reason.get(reason, 0) + n
        states = report.channels.setdefault(channel, {})
        states[state] = states.get(state, 0) + n
        report.rows_purged += n
        if state != ledger.State.DELIVERED:
            report.rows_purged_missing += n


async def rows_purged_missing(executor: ledger.Executor, run_id: int) -> int:
    """Rows of the run retention purged that were not delivered (no longer listed)."""
    counts: dict[str, int] = await executor.fetchval(db.q("run_purged_counts"), run_id) or {}
    return sum(n for key, n in counts.items() if key.split("/")[1] != ledger.State.DELIVERED)


async def _count_states(
    executor: ledger.Executor, found: dict[int, RunReport], now: datetime
) -> None:
    """Fill in each report's delivery states, skip reasons and oldest pending age."""
    for row in await executor.fetch(db.q("run_state_counts"), list(found)):
        report = found[row["run_id"]]
        report.states[row["state"]] = report.states.get(row["state"], 0) + row["n"]
        if row["state"] == ledger.State.SKIPPED:
            report.skipped_by_reason[row["skip_reason"]] = row["n"]
        if row["oldest_pending"] is not None:
            report.oldest_pending_seconds = (now - row["oldest_pending"]).total_seconds()
        report.content_purged += row["content_purged"]
    for row in await executor.fetch(db.q("run_channel_counts"), list(found)):
        states = found[row["run_id"]].channels.setdefault(row["channel"], {})
        states[row["state"]] = row["n"]
