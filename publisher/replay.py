"""``relay replay``: move dead deliveries back into the pipeline, from the queue or the ledger.

From the queue (``--from queue``): for each dead letter, reset its ledger row for another
round of attempts (``dead`` -> ``pending``; the attempt history stays), republish the
delivery with a confirm, mark it ``queued``, and only then ack the dead letter. A dead
letter whose row is not ``dead`` (delivered meanwhile, or already replayed) is acked as
stale; one that is not a delivery message at all is left in the queue and reported.

From the ledger (``--from ledger``), for when the queue was purged: select rows by state
(default ``dead``), time range, run, reminder, provider, channel, key or last status, in
bounded pages. ``dead`` rows are reset as above; ``pending``/``queued``/``retrying`` rows
are republished as they are (the claim makes an extra message harmless). ``delivered``
and ``skipped`` rows are never replayed.

Both default to a dry run that prints what would happen; ``--apply`` does it. Every
replay is recorded in the ``replays`` table (who, when, filters, how many).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
from aio_pika.abc import AbstractIncomingMessage

from service import amqp, db, ledger, logs, messages
from service.telemetry import Metrics

log = logs.get("replay")

REPLAYABLE = ("dead", "pending", "queued", "retrying")
PAGE = 500


@dataclass(frozen=True)
class LedgerFilter:
    states: tuple[str, ...] = ("dead",)
    since: datetime | None = None
    until: datetime | None = None
    run_id: int | None = None
    reminder_id: str | None = None
    provider: str | None = None
    channel: str | None = None
    key: str | None = None
    last_status: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            k: (v.isoformat() if isinstance(v, datetime) else v)
            for k, v in self.__dict__.items()
            if v is not None
        }


@dataclass
class ReplaySummary:
    source: str
    apply: bool
    selected: int = 0
    replayed: int = 0  # republished and confirmed
    stale: int = 0  # dead letters whose row was no longer dead
    undecodable: int = 0  # dead letters that are not delivery messages (left in the queue)
    failed: int = 0  # not confirmed by the broker (left for the next replay)
    sample: list[int] = field(default_factory=list)

    def render(self) -> str:
        verb = "replayed" if self.apply else "would replay"
        text = (
            f"replay from {self.source}: selected={self.selected} {verb}="
            f"{self.replayed if self.apply else self.selected - self.stale - self.undecodable}"
            f" stale={self.stale} undecodable={self.undecodable} failed={self.failed}"
        )
        if self.sample:
            text += f"\n  delivery ids: {', '.join(map(str, self.sample))}"
            if self.selected > len(self.sample):
                text += ", ..."
        if not self.apply:
            text += "\n  dry run: nothing changed; add --apply to do it"
        return text


class Replayer:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        publisher: amqp.ConfirmedPublisher,
        metrics: Metrics,
        operator: str,
    ) -> None:
        self._pool = pool
        self._publisher = publisher
        self._metrics = metrics
        self._operator = operator

    async def _republish(
        self, rows: Sequence[tuple[int, bool]], summary: ReplaySummary
    ) -> set[int]:
        confirmed, failed = await self._publisher.publish_many(rows)
        # Confirmed first, then queued: a crash in between leaves rows pending for the
        # next publish run, never a row marked queued without a message.
        await ledger.mark_queued(self._pool, confirmed)
        summary.replayed += len(confirmed)
        summary.failed += len(failed)
        self._metrics.replays.add(len(confirmed))
        return set(confirmed)

    async def _reset(self, ids: Sequence[int]) -> list[tuple[int, bool]]:
        rows = await self._pool.fetch(db.q("reset_for_replay"), list(ids))
        return [(r["id"], r["urgent"]) for r in rows]

    async def from_ledger(self, filters: LedgerFilter, *, limit: int, apply: bool) -> ReplaySummary:
        states = [s for s in filters.states if s in REPLAYABLE]
        summary = ReplaySummary("ledger", apply)
        audit = await self._audit_start("ledger", filters.as_json()) if apply else None
        after_id = 0
        while summary.selected < limit and states:
            page = await self._pool.fetch(
                db.q("replay_select"),
                states,
                filters.since,
                filters.until,
                filters.run_id,
                filters.reminder_id,
                filters.provider,
                filters.channel,
                filters.key,
                filters.last_status,
                after_id,
                min(PAGE, limit - summary.selected),
            )
            if not page:
                break
            after_id = page[-1]["id"]
            summary.selected += len(page)
            summary.sample.extend(r["id"] for r in page[: max(0, 20 - len(summary.sample))])
            if apply:
                dead = [r["id"] for r in page if r["state"] == "dead"]
                live = [(r["id"], r["urgent"]) for r in page if r["state"] != "dead"]
                reset = await self._reset(dead)
                summary.stale += len(dead) - len(reset)
                await self._republish(reset + live, summary)
                log.info(
                    "replay progress",
                    extra={
                        "event": "replay_progress",
                        "selected": summary.selected,
                        "replayed": summary.replayed,
                    },
                )
        if audit is not None:
            await self._audit_finish(audit, summary)
        return summary

    async def from_queue(
        self, topology: amqp.Topology, channel: Any, *, limit: int, apply: bool
    ) -> ReplaySummary:
        summary = ReplaySummary("dead-letter-queue", apply)
        queue = await channel.declare_queue(topology.dead_queue, passive=True)
        audit = await self._audit_start("dead-letter-queue", {"limit": limit}) if apply else None
        held: list[AbstractIncomingMessage] = []  # unacked until the end: not fetched twice
        while summary.selected < limit:
            message = await queue.get(no_ack=False, fail=False)
            if message is None:
                break
            summary.selected += 1
            try:
                delivery_id = messages.decode(message.body).delivery_id
            except messages.MessageError:
                summary.undecodable += 1
                held.append(message)
                continue
            if len(summary.sample) < 20:
                summary.sample.append(delivery_id)
            if not apply:
                held.append(message)
                continue
            row = await self._pool.fetchrow(db.q("delivery_lane"), delivery_id)
            if row is None or row["state"] != "dead":
                summary.stale += 1
                await message.ack()  # its row moved on: the dead letter is obsolete
                continue
            reset = await self._reset([delivery_id])
            if reset and delivery_id in await self._republish(reset, summary):
                await message.ack()
            else:
                held.append(message)
        for message in held:
            await message.nack(requeue=True)
        if audit is not None:
            await self._audit_finish(audit, summary)
        return summary

    async def _audit_start(self, source: str, filters: dict[str, Any]) -> int:
        return int(
            await self._pool.fetchval(db.q("replay_started"), source, self._operator, filters)
        )

    async def _audit_finish(self, audit_id: int, summary: ReplaySummary) -> None:
        await self._pool.execute(
            db.q("replay_finished"), audit_id, summary.selected, summary.replayed
        )
        log.info(
            "replay finished",
            extra={
                "event": "replay_finished",
                "replay_id": audit_id,
                "selected": summary.selected,
                "replayed": summary.replayed,
                "operator": self._operator,
            },
        )
