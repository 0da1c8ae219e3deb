"""``relay replay``: move dead deliveries back into the pipeline, from the queue or the ledger.

From the queue (``--from queue``), each dead letter is judged by its row in the ledger:

- row ``dead``: reset it for another round of attempts (``dead`` -> ``pending``; the
  attempt history stays), republish the delivery with a confirm, mark it ``queued``, and
  only then ack the dead letter (*replayed*);
- row still owed (``pending``/``queued``/``sending``/``retrying``): the broker's poison
  guard dead-lettered a message whose row is not dead; republish it as it is and ack the
  dead letter (*requeued*), so the row does not wait for rescue;
- row ``delivered``/``skipped`` or gone: the dead letter is obsolete and acked (*stale*);
- not a delivery message at all: left in the queue and reported (*undecodable*).

A queue replay takes a bound when it starts (the queue's length then) and never reads a
dead letter published after it began, so beside running consumers it cannot chase the
dead letters its own replays produce.

From the ledger (``--from ledger``), for when the queue was purged: select rows by state
(default ``dead``), time range, run, reminder, provider, channel, key or last status, in
bounded pages. ``dead`` rows are reset as above; ``pending``/``queued``/``retrying`` rows
are republished as they are (the claim makes an extra message harmless). ``delivered``
and ``skipped`` rows are never replayed. Statements lock rows in id order and retry a
lost deadlock, so a ledger replay is safe beside running consumers.

Both default to a dry run that applies the same rules and reports the same numbers
without changing anything; ``--apply`` does it. Every applied replay is recorded in the
``replays`` table (who, when, filters, how many).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from publisher.dead_queue import DeadLetterRead
from service import amqp, db, ledger, logs, messages, publishing, signals
from service.ledger import State, publication, replays
from service.progress import Progress
from service.settings import Settings
from service.telemetry import Metrics

log = logs.get("replay")

REPLAYABLE = (State.DEAD, State.PENDING, State.QUEUED, State.RETRYING)
PAGE = 500
_CLOSE_SECONDS = 5.0


LedgerFilter = replays.ReplayFilter


def _filters_json(selection: LedgerFilter) -> dict[str, Any]:
    return {
        k: (v.isoformat() if isinstance(v, datetime) else v)
        for k, v in selection.__dict__.items()
        if v is not None
    }


@dataclass
class ReplaySummary:
    source: str
    apply: bool
    selected: int = 0
    replayed: int = 0  # rows republished (confirmed); dry run: would be
    requeued: int = 0  # of those, rows that were not dead (their message was lost)
    stale: int = 0  # dead letters whose row was final or gone (acked)
    undecodable: int = 0  # dead letters that are not delivery messages (left in the queue)
    failed: int = 0  # not confirmed by the broker (left for the next replay)
    interrupted: bool = False  # stopped by SIGTERM or SIGINT: the counts are what it did
    sample: list[int] = field(default_factory=list)

    def render(self) -> str:
        verb = "replayed" if self.apply else "would replay"
        text = (
            f"replay from {self.source}: selected={self.selected} {verb}={self.replayed} "
            f"(not dead: {self.requeued}) stale={self.stale} undecodable={self.undecodable} "
            f"failed={self.failed}"
        )
        if self.sample:
            text += f"\n  delivery ids: {', '.join(map(str, self.sample))}"
            if self.selected > len(self.sample):
                text += ", ..."
        if self.interrupted:
            text += (
                "\n  interrupted by a signal: the counts are what it did; run it again for the rest"
            )
        if not self.apply:
            text += "\n  dry run: nothing changed; add --apply to do it"
        return text


class Replayer:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        publisher: publishing.ConfirmedPublisher,
        metrics: Metrics,
        operator: str,
        reason: str | None = None,
    ) -> None:
        self._pool = pool
        self._reason = reason  # recorded with the replay's filters (the console asks why)
        self._publisher = publisher
        self._metrics = metrics
        self._operator = operator
        self._judged: set[int] = set()  # rows this queue replay already decided on

    async def _republish(self, rows: Sequence[tuple[int, bool]]) -> tuple[list[int], list[int]]:
        if not rows:
            return [], []
        confirmed, failed = await self._publisher.publish_many(rows)
        # Confirmed first, then queued: a crash in between leaves rows pending for the
        # next publish run, never a row marked queued without a message.
        await publication.mark_queued(self._pool, confirmed)
        self._metrics.replays.add(len(confirmed))
        return confirmed, failed

    async def from_ledger(
        self,
        filters: LedgerFilter,
        *,
        limit: int,
        apply: bool,
        summary: ReplaySummary | None = None,
    ) -> ReplaySummary:
        """Replay (or count) the rows ``filters`` select, into ``summary`` if given (a
        caller that may stop the replay reads what it did there)."""
        selection = dataclasses.replace(
            filters, states=tuple(s for s in filters.states if s in REPLAYABLE)
        )
        summary = summary or ReplaySummary("ledger", apply)
        async with self._audited("ledger", _filters_json(filters), summary, apply) as audit:
            await self._ledger_pages(selection, summary, limit=limit, audit=audit)
        return summary

    async def _ledger_pages(
        self, selection: LedgerFilter, summary: ReplaySummary, *, limit: int, audit: int | None
    ) -> None:
        after_id = 0
        progress = Progress("replay")
        while summary.selected < limit and selection.states:
            page = await replays.select_for_replay(
                self._pool, selection, after_id, min(PAGE, limit - summary.selected)
            )
            if not page:
                break
            after_id = page[-1][0]
            summary.selected += len(page)
            progress.update(summary.selected)
            summary.sample.extend(i for i, _, _ in page[: max(0, 20 - len(summary.sample))])
            dead = [i for i, state, _ in page if state is State.DEAD]
            live = [(i, urgent) for i, state, urgent in page if state is not State.DEAD]
            if audit is None:  # a dry run
                summary.replayed += len(page)
                summary.requeued += len(live)
                continue
            reset = await replays.reset_for_replay(self._pool, dead)
            summary.stale += len(dead) - len(reset)
            confirmed, failed = await self._republish(reset + live)
            summary.replayed += len(confirmed)
            summary.requeued += len({i for i, _ in live} & set(confirmed))
            summary.failed += len(failed)
            await replays.replay_progress(self._pool, audit, summary.selected, summary.replayed)
            log.info(
                "replay progress",
                extra={
                    "event": "replay_progress",
                    "selected": summary.selected,
                    "replayed": summary.replayed,
                },
            )
        progress.finish()

    async def from_queue(
        self,
        topology: amqp.Topology,
        channel: AbstractChannel,
        *,
        limit: int,
        apply: bool,
        summary: ReplaySummary | None = None,
    ) -> ReplaySummary:
        """Judge (or count) the dead letters the queue holds now, into ``summary`` if
        given (as ``from_ledger``)."""
        summary = summary or ReplaySummary("dead-letter-queue", apply)
        queue = await channel.declare_queue(topology.dead_queue, passive=True)
        # The bound: what the queue held when the replay began. Dead letters produced
        # after that (by replays failing again) are never read by this replay.
        read = DeadLetterRead(queue, limit=limit, progress="replay")
        async with self._audited("dead-letter-queue", {"limit": limit}, summary, apply) as audit:
            try:
                async for message in read.letters():
                    summary.selected += 1
                    if not await self._judge(message, summary, apply):
                        read.hold(message)
                    if audit is not None and summary.selected % PAGE == 0:
                        await replays.replay_progress(
                            self._pool, audit, summary.selected, summary.replayed
                        )
            finally:
                await read.close()
        return summary

    @contextlib.asynccontextmanager
    async def _audited(
        self, source: str, filters: dict[str, Any], summary: ReplaySummary, apply: bool
    ) -> AsyncIterator[int | None]:
        """An applied replay's record (its id; None for a dry run): its start, its
        progress as the caller records it, and its end, also when a signal stops it (what
        it did until then, and that it was interrupted)."""
        async with contextlib.AsyncExitStack() as stack:
            audit = None
            if apply:
                if self._reason:
                    filters = filters | {"reason": self._reason}
                audit = await stack.enter_async_context(
                    replays.recorded(self._pool, source, self._operator, filters)
                )
            try:
                yield audit
            except asyncio.CancelledError:
                summary.interrupted = True
                if audit is not None:
                    await self._audit_finish(audit, summary)
                raise
            if audit is not None:
                await self._audit_finish(audit, summary)

    async def _judge(
        self, message: AbstractIncomingMessage, summary: ReplaySummary, apply: bool
    ) -> bool:
        """Apply (or count) the rule for one dead letter; True if it may be acked."""
        try:
            delivery_id = messages.decode(message.body).delivery_id
        except messages.MessageError:
            summary.undecodable += 1
            return False
        if len(summary.sample) < 20:
            summary.sample.append(delivery_id)
        # A row with several dead letters (it died, was replayed, died again) is replayed
        # once; its other letters are obsolete.
        repeated = delivery_id in self._judged
        self._judged.add(delivery_id)
        row = None if repeated else await replays.state_of(self._pool, delivery_id)
        if row is None or (row[0] in ledger.FINAL_STATES and row[0] is not State.DEAD):
            summary.stale += 1
            if not apply:
                return False
            await message.ack()  # its row is done: the dead letter is obsolete
            return True
        state, urgent = row
        if not apply:
            summary.replayed += 1
            summary.requeued += state is not State.DEAD
            return False
        items = await replays.reset_for_replay(self._pool, [delivery_id])
        if state is not State.DEAD:
            items = [(delivery_id, urgent)]
        if not items:  # it left 'dead' between the read and the reset
            summary.stale += 1
            await message.ack()
            return True
        confirmed, failed = await self._republish(items)
        if not confirmed:
            summary.failed += len(failed)
            return False
        summary.replayed += 1
        summary.requeued += state is not State.DEAD
        await message.ack()
        return True

    async def _audit_finish(self, audit_id: int, summary: ReplaySummary) -> None:
        await replays.replay_finished(
            self._pool,
            audit_id,
            summary.selected,
            summary.replayed,
            interrupted=summary.interrupted,
        )
        log.info(
            "replay interrupted" if summary.interrupted else "replay finished",
            extra={
                "event": "replay_finished",
                "replay_id": audit_id,
                "selected": summary.selected,
                "replayed": summary.replayed,
                "requeued": summary.requeued,
                "interrupted": summary.interrupted,
                "operator": self._operator,
            },
        )


async def run(
    settings: Settings,
    *,
    metrics: Metrics,
    operator: str,
    source: str,
    filters: LedgerFilter,
    limit: int,
    apply: bool,
) -> ReplaySummary:
    """Composition root of ``relay replay``: every exit path closes what it opened.

    SIGTERM or SIGINT stop it between rows (a page it is publishing is cancelled: those
    rows stay ``pending`` for the next publish run, their dead letters unacked); its audit
    row records what it did and that it was interrupted, and so does the summary.
    """
    async with contextlib.AsyncExitStack() as stack:
        pool = await db.create_pool(settings, size=2)
        stack.push_async_callback(db.close_pool, pool, _CLOSE_SECONDS)
        connection, publisher = await publishing.open_publisher(settings, "relay-replay")
        stack.push_async_callback(amqp.close_connection, connection, _CLOSE_SECONDS)
        replayer = Replayer(pool=pool, publisher=publisher, metrics=metrics, operator=operator)
        summary = ReplaySummary("dead-letter-queue" if source == "queue" else "ledger", apply)
        with signals.cancelling_on_signals():
            if source == "queue":
                channel = await connection.channel()
                topology = amqp.Topology.from_settings(settings)
                await replayer.from_queue(
                    topology, channel, limit=limit, apply=apply, summary=summary
                )
            else:
                await replayer.from_ledger(filters, limit=limit, apply=apply, summary=summary)
        return summary
    raise AssertionError("unreachable")  # the exit stack does not swallow exceptions
