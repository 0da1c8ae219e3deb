"""``relay replay --from queue --drop``: acknowledge dead letters that must never be
replayed, without replaying them.

A dead letter is dropped when its body is not a delivery message (undecodable), when it
names no delivery the ledger has (unknown id), or when its delivery matches every filter
given (``--run``, ``--reminder``, ``--channel``, ``--provider``, ``--key``,
``--last-status``, ``--state``, ``--since``, ``--until``). Without a filter only the
first two are dropped. Every other dead letter is handed back to the queue untouched. A
dry run (the default) counts without acknowledging anything; an applied drop is recorded
in ``replays`` (source ``drop``: who, when, filters, how many).

Like a replay, it reads at most what the queue held when it began.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aio_pika.abc import AbstractIncomingMessage

from publisher.dead_queue import DeadLetterRead
from service import amqp, db, logs, messages, signals
from service.ledger import replays
from service.settings import Settings

log = logs.get("replay")
_CLOSE_SECONDS = 5.0
_PROGRESS_EVERY = 500  # dead letters between records of a drop's counts so far


@dataclass
class DropSummary:
    apply: bool
    selected: int = 0  # dead letters read
    dropped: int = 0  # acknowledged without a replay (dry run: would be)
    undecodable: int = 0
    unknown: int = 0
    matched: int = 0
    kept: int = 0  # handed back to the queue
    interrupted: bool = False  # stopped by SIGTERM or SIGINT: the counts are what it did
    sample: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"source": "drop", **self.__dict__}

    def render(self) -> str:
        verb = "dropped" if self.apply else "would drop"
        text = (
            f"drop from dead-letter-queue: selected={self.selected} {verb}={self.dropped} "
            f"(undecodable {self.undecodable}, unknown id {self.unknown}, matching "
            f"{self.matched}) kept={self.kept}"
        )
        if self.sample:
            text += f"\n  delivery ids: {', '.join(map(str, self.sample))}"
        if self.interrupted:
            text += (
                "\n  interrupted by a signal: the counts are what it did; run it again for the rest"
            )
        if not self.apply:
            text += "\n  dry run: nothing changed; add --apply to do it"
        return text


def matches(row: asyncpg.Record, filters: replays.ReplayFilter, states_given: bool) -> bool:
    """Whether a delivery matches every filter given (none given: it does not match)."""
    checks = [
        (filters.run_id, row["run_id"]),
        (filters.reminder_id, row["reminder_id"]),
        (filters.provider, row["provider"]),
        (filters.channel, row["channel"]),
        (filters.key, row["key"]),
        (filters.last_status, row["last_status"]),
    ]
    given = [(want, have) for want, have in checks if want is not None]
    if states_given:
        given.append((True, row["state"] in {s.value for s in filters.states}))
    if filters.since is not None:
        given.append((True, row["created_at"] >= filters.since))
    if filters.until is not None:
        given.append((True, row["created_at"] < filters.until))
    return bool(given) and all(want == have for want, have in given)


async def _judge(
    pool: asyncpg.Pool,
    message: AbstractIncomingMessage,
    filters: replays.ReplayFilter,
    states_given: bool,
    summary: DropSummary,
) -> bool:
    """Whether to drop this dead letter (and count why)."""
    try:
        delivery_id = messages.decode(message.body).delivery_id
    except messages.MessageError:
        summary.undecodable += 1
        return True
    row = await replays.delivery_for_drop(pool, delivery_id)
    if row is None:
        summary.unknown += 1
    elif matches(row, filters, states_given):
        summary.matched += 1
    else:
        return False
    if len(summary.sample) < 20:
        summary.sample.append(delivery_id)
    return True


async def drop(
    settings: Settings,
    *,
    operator: str,
    filters: replays.ReplayFilter,
    states_given: bool,
    limit: int,
    apply: bool,
) -> DropSummary:
    """Composition root of ``relay replay --from queue --drop``. SIGTERM or SIGINT stop
    it between dead letters; its record (if applied) gets its counts so far and
    ``interrupted``, and so does the summary."""
    summary = DropSummary(apply)
    async with contextlib.AsyncExitStack() as stack:
        pool = await db.create_pool(settings, size=2)
        stack.push_async_callback(db.close_pool, pool, _CLOSE_SECONDS)
        connection = await amqp.connect(settings, name="relay-replay-drop")
        stack.push_async_callback(amqp.close_connection, connection, _CLOSE_SECONDS)
        channel = await connection.channel()
        queue = await channel.declare_queue(
            amqp.Topology.from_settings(settings).dead_queue, passive=True
        )
        read = DeadLetterRead(queue, limit=limit, progress="drop")
        audit = None
        if apply:
            record = {k: v for k, v in filters.__dict__.items() if v is not None}
            record["states"] = [s.value for s in filters.states] if states_given else None
            audit = await stack.enter_async_context(
                replays.recorded(pool, "drop", operator, _jsonable(record))
            )
        with signals.cancelling_on_signals():
            await _drop_letters(read, pool, audit, filters, states_given, summary)
        if audit is not None:
            await replays.drop_finished(
                pool, audit, summary.selected, summary.dropped, interrupted=summary.interrupted
            )
            log.info(
                "dead letters dropped",
                extra={"event": "replay_dropped", "replay_id": audit, "dropped": summary.dropped},
            )
    return summary


async def _drop_letters(
    read: DeadLetterRead,
    pool: asyncpg.Pool,
    audit: int | None,
    filters: replays.ReplayFilter,
    states_given: bool,
    summary: DropSummary,
) -> None:
    """Judge each dead letter the read yields: ack it (``audit``: an applied drop) or hand
    it back; recorded every ``_PROGRESS_EVERY`` letters, so a killed drop leaves its counts."""
    try:
        async for message in read.letters():
            summary.selected += 1
            if audit is not None and summary.selected % _PROGRESS_EVERY == 0:
                # Counted up to the letter before this one.
                done = summary.selected - 1
                await replays.replay_progress(pool, audit, done, 0, summary.dropped)
            if not await _judge(pool, message, filters, states_given, summary):
                summary.kept += 1
                read.hold(message)
                continue
            if audit is not None:
                await message.ack()
            else:
                read.hold(message)  # a dry run drops nothing
            summary.dropped += 1
    except asyncio.CancelledError:
        # The letter being judged was neither acked nor held: the broker returns it when
        # the channel closes, and it counts as read but not dropped.
        summary.interrupted = True
        raise
    finally:
        await read.close()


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in record.items()}
