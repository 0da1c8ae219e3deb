"""Settling a delivery message: the only code that acks, nacks or publishes a copy of one.

The worker decides a ``Disposition`` per message (``consumer/worker.py``); ``Settler``
carries it out on the broker, always durable first: the retry copy, the dead letter or
the hand-back copy is published and confirmed, and **only then** is the message acked.
A message whose channel closed meanwhile is left to the broker (it has put it back); a
publish the broker did not confirm leaves the message unacked (it is redelivered) and
ends the session.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from consumer.acks import GroupedAcks
from consumer.dispositions import Ack, DeadLetter, Disposition, GiveBack, Leave, Redelay, Requeue
from consumer.incoming import Incoming
from service import amqp, errors, logs, publishing, telemetry
from service.crashpoints import CrashPoints

log = logs.get("consumer")


class Settler:
    """One per consume channel; construct with every dependency.

    ``mark_dead_lettered(delivery_id, attempt)`` stamps a dead row once its dead letter is
    confirmed; ``wall`` is the clock of the dead letter's ``x-relay-dead-at`` (Unix s).
    """

    def __init__(
        self,
        *,
        publisher: publishing.ConfirmedPublisher,
        mark_dead_lettered: Callable[[int, int], Awaitable[None]],
        on_broker_failure: Callable[[], None],
        acks: GroupedAcks | None = None,
        crash: CrashPoints | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._publisher = publisher
        self._mark_dead_lettered = mark_dead_lettered
        self._on_broker_failure = on_broker_failure
        self._acks = acks
        self._crash = crash or CrashPoints()
        self._wall = wall
        self.left_to_broker = 0  # settled after their channel closed: the broker has them

    async def settle(self, message: Incoming, disposition: Disposition) -> None:
        """Do what ``disposition`` says with ``message``; never raises."""
        if not message.settleable:
            # Its channel closed: the broker put it back, so no ack, nack or copy (a
            # second message). Its redelivery reads what was done from the ledger.
            self.left_to_broker += 1
            return
        trace_headers = telemetry.trace_headers(message.headers)
        try:
            match disposition:
                case Ack():
                    await self._ack(message)
                case Redelay(lane=lane, seconds=seconds):
                    await self._publisher.publish_delayed(
                        message.body, lane=lane, remaining_seconds=seconds, headers=trace_headers
                    )
                    self._crash.hit("after_publish")
                    await self._ack(message)
                case DeadLetter():
                    await self._publish_dead_letter(message, disposition, trace_headers)
                    self._crash.hit("after_publish")
                    await self._ack(message)
                case GiveBack(lane=lane):
                    await self._give_back(message, lane, trace_headers)
                case Requeue():
                    await self._nack(message)
                case Leave():
                    pass
        except errors.PublishError:
            # The broker did not confirm: it is failing. Leave the message unacked (it is
            # redelivered) and let the process restart on a fresh connection.
            log.error("broker did not confirm a publish", extra={"event": "publish_failed"})
            self._on_broker_failure()
        except Exception as exc:
            log.warning(
                "could not settle a message; the broker will redeliver it",
                extra={"event": "settle_failed", "error": type(exc).__name__},
            )

    async def _publish_dead_letter(
        self,
        message: Incoming,
        letter: DeadLetter,
        trace_headers: dict[str, Any],
    ) -> None:
        headers: dict[str, Any] = {
            **trace_headers,
            **letter.headers,
            amqp.REASON_HEADER: letter.reason,
            amqp.DEAD_AT_HEADER: int(self._wall() * 1000),
            "x-relay-source-queue": message.routing_key or "",
        }
        if letter.dead_row is not None:
            headers["x-relay-delivery-id"], headers["x-relay-attempts"] = letter.dead_row
        await self._publisher.publish_dead(message.body, headers)
        if letter.dead_row is not None:
            try:
                await self._mark_dead_lettered(*letter.dead_row)
            except errors.Abandoned:
                pass  # the dead letter is in its queue; only the row's stamp is missing

    async def _give_back(self, message: Incoming, lane: str, trace_headers: dict[str, Any]) -> None:
        try:
            await self._publisher.publish_copy(message.body, lane=lane, headers=trace_headers)
        except errors.PublishError:
            await self._nack(message)
            return
        await self._ack(message)

    async def _ack(self, message: Incoming) -> None:
        """Acknowledge: grouped with its neighbours when it can be (``consumer/acks.py``)."""
        if self._acks is None or message.delivery_tag is None:
            await message.ack()
        else:
            self._acks.ack(message.delivery_tag)

    async def _nack(self, message: Incoming) -> None:
        """Return the message to its queue (counts toward its delivery limit)."""
        if self._acks is not None and message.delivery_tag is not None:
            self._acks.dropped(message.delivery_tag)
        await message.nack(requeue=True)
