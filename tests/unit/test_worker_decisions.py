"""The worker's decisions that need no server: what becomes of a message whose row cannot
be claimed, and how each ``Disposition`` is settled on the broker. The AMQP channel is a
stand-in that records the frames (acks, nacks, publishes and their confirms); the clock
of the dead letters' ``x-relay-dead-at`` is the test's. Claims, outcome writes and the
dead row's stamp keep their integration tests (``tests/integration/test_pipeline.py``,
``test_poison_isolation.py``, ``test_fenced_outcomes.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import aiormq
import pytest
from aiormq.abc import DeliveredMessage
from pamqp import commands
from pamqp.header import ContentHeader

from consumer import decisions
from consumer.acks import GroupedAcks
from consumer.dispositions import (
    Ack,
    DeadLetter,
    Disposition,
    GiveBack,
    Leave,
    Redelay,
    Requeue,
)
from consumer.incoming import Incoming
from consumer.settle import Settler
from service import amqp, ledger, publishing
from service.ledger import State, Unclaimable
from service.settings import Settings

DB_NOW = datetime(2026, 3, 1, 6, 0, tzinfo=UTC)
WALL = 1_780_000_000.25  # the settler's clock (Unix seconds)
TOPOLOGY = amqp.Topology.from_settings(
    Settings(amqp_namespace="unit", delay_tiers_seconds=[1.0, 5.0, 30.0])
)
BODY = b'{"v": 1, "delivery_id": 7}'
TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


# ------------------------------------------------------------------ unclaimable rows


def _row(state: State, **changes: Any) -> Unclaimable:
    fields: dict[str, Any] = {"next_attempt_at": None, "lease_expires_at": None, **changes}
    return Unclaimable(id=7, state=state, now=DB_NOW, **fields)


def test_a_dead_row_whose_dead_letter_was_never_confirmed_gets_it_from_this_message() -> None:
    error = "rejected: http 400"
    row = _row(State.DEAD, attempts=4, last_error=error, last_status=400, dead_letter_missing=True)
    assert decisions.message_for_unclaimable(row, amqp.BULK) == DeadLetter(
        "rejected: http 400", dead_row=(7, 4), headers={"x-relay-last-status": 400}
    )
    bare = _row(State.DEAD, attempts=4, dead_letter_missing=True)
    assert decisions.message_for_unclaimable(bare, amqp.BULK) == DeadLetter(
        "dead", dead_row=(7, 4), headers={"x-relay-last-status": 0}
    )


@pytest.mark.parametrize("state", sorted(ledger.FINAL_STATES, key=lambda s: s.value))
def test_a_message_for_a_final_row_is_acked_and_never_sent_again(state: State) -> None:
    assert decisions.message_for_unclaimable(_row(state), amqp.BULK) == Ack()


def test_a_message_for_a_row_on_the_wire_is_parked_until_its_lease_ends() -> None:
    row = _row(State.SENDING, lease_expires_at=DB_NOW + timedelta(seconds=42.5))
    assert decisions.message_for_unclaimable(row, amqp.URGENT) == Redelay(amqp.URGENT, 42.5)


def test_a_message_for_a_retrying_row_is_parked_until_its_retry_time() -> None:
    row = _row(State.RETRYING, next_attempt_at=DB_NOW + timedelta(seconds=8))
    assert decisions.message_for_unclaimable(row, amqp.BULK) == Redelay(amqp.BULK, 8.0)
    overdue = _row(State.RETRYING, next_attempt_at=DB_NOW - timedelta(seconds=3))
    assert decisions.message_for_unclaimable(overdue, amqp.BULK) == Redelay(amqp.BULK, 0.0)


def test_a_message_that_came_early_is_parked_until_its_row_is_due() -> None:
    row = _row(State.QUEUED, early_seconds=12.0)
    assert decisions.message_for_unclaimable(row, amqp.BULK) == Redelay(amqp.BULK, 12.0)


# ------------------------------------------------------------------ settling


@dataclass
class FakeChannel:
    """The AMQP channel, both the one messages arrive on (aiormq: ``basic_ack``,
    ``basic_nack``) and the publisher's (its aiormq underlay: ``basic_publish``, which
    returns once the broker confirmed). ``unconfirmed``: exchanges whose publishes the
    broker does not confirm (a nack)."""

    frames: list[tuple[Any, ...]] = field(default_factory=list)
    unconfirmed: set[str] = field(default_factory=set)
    is_closed: bool = False

    async def basic_ack(self, tag: int, multiple: bool = False) -> None:
        self.frames.append(("ack", tag, multiple))

    async def basic_nack(self, tag: int, requeue: bool = True) -> None:
        self.frames.append(("nack", tag, requeue))

    async def get_underlay_channel(self) -> FakeChannel:
        return self

    async def basic_publish(
        self,
        body: bytes,
        *,
        exchange: str,
        routing_key: str,
        properties: aiormq.spec.Basic.Properties,
        mandatory: bool,
    ) -> None:
        assert mandatory  # an unroutable message is an error, never a silent drop
        if exchange in self.unconfirmed:
            raise aiormq.exceptions.DeliveryError(None, None)
        headers = dict(properties.headers or {})
        self.frames.append(("publish", exchange, routing_key, body, headers))


def _message(channel: FakeChannel, tag: int = 5, lane: str = amqp.BULK) -> Incoming:
    frame = commands.Basic.Deliver(
        consumer_tag="ctag", delivery_tag=tag, exchange=TOPOLOGY.work_exchange, routing_key=lane
    )
    properties = commands.Basic.Properties(headers=dict(TRACE))
    header = ContentHeader(body_size=len(BODY), properties=properties)
    return Incoming(DeliveredMessage(frame, header, BODY, channel))  # type: ignore[arg-type]


class Settled:
    """A settler over a fake channel, and what it asked for beside the channel."""

    def __init__(self, channel: FakeChannel) -> None:
        self.broker_failures = 0
        self.acks = GroupedAcks(channel.basic_ack)
        publisher = publishing.ConfirmedPublisher(
            channel,  # type: ignore[arg-type]
            TOPOLOGY,
            max_in_flight=10,
            timer_max_in_flight=10,
            confirm_timeout_seconds=5.0,
        )
        self.settler = Settler(
            publisher=publisher,
            mark_dead_lettered=_no_dead_row,
            on_broker_failure=self._broker_failed,
            acks=self.acks,
            wall=lambda: WALL,
        )

    def _broker_failed(self) -> None:
        self.broker_failures += 1

    async def settle(self, message: Incoming, disposition: Disposition) -> None:
        self.acks.opened(5)
        await self.settler.settle(message, disposition)
        await self.acks.close()  # the grouped ack frame goes out


async def _no_dead_row(delivery_id: int, attempt: int) -> None:
    raise AssertionError("a message without a dead row stamps no row")


async def test_ack_acknowledges_the_message_and_publishes_nothing() -> None:
    channel = FakeChannel()
    await Settled(channel).settle(_message(channel), Ack())
    assert channel.frames == [("ack", 5, True)]


async def test_redelay_publishes_to_the_tier_that_fits_then_acks() -> None:
    channel = FakeChannel()
    await Settled(channel).settle(_message(channel), Redelay(amqp.URGENT, 7.0))
    tier = {amqp.TIER_HEADER: TOPOLOGY.delay_queue(5.0)}  # the largest tier not over 7 s
    assert channel.frames == [
        ("publish", TOPOLOGY.delay_exchange, amqp.URGENT, BODY, {**TRACE, **tier}),
        ("ack", 5, True),
    ]


async def test_a_poison_message_goes_to_the_dead_letters_with_why_and_when_then_is_acked() -> None:
    channel = FakeChannel()
    await Settled(channel).settle(_message(channel), DeadLetter("unsupported schema version: 7"))
    headers = {
        **TRACE,
        amqp.REASON_HEADER: "unsupported schema version: 7",
        amqp.DEAD_AT_HEADER: 1_780_000_000_250,
        "x-relay-source-queue": amqp.BULK,
    }
    assert channel.frames == [
        ("publish", TOPOLOGY.dead_exchange, "", BODY, headers),
        ("ack", 5, True),
    ]


async def test_give_back_publishes_a_fresh_copy_to_the_lane_then_acks() -> None:
    channel = FakeChannel()
    await Settled(channel).settle(_message(channel), GiveBack(amqp.BULK))
    assert channel.frames == [
        ("publish", TOPOLOGY.work_exchange, amqp.BULK, BODY, TRACE),
        ("ack", 5, True),
    ]


async def test_a_copy_the_broker_did_not_confirm_is_a_nack_instead() -> None:
    channel = FakeChannel(unconfirmed={TOPOLOGY.work_exchange})
    settled = Settled(channel)
    await settled.settle(_message(channel), GiveBack(amqp.BULK))
    assert channel.frames == [("nack", 5, True)]
    assert settled.broker_failures == 0  # handed back either way: the session goes on


@pytest.mark.parametrize(
    "disposition", [Redelay(amqp.BULK, 1.0), DeadLetter("poison")], ids=["redelay", "dead"]
)
async def test_a_parked_copy_or_dead_letter_not_confirmed_leaves_the_message_unacked(
    disposition: Disposition,
) -> None:
    channel = FakeChannel(unconfirmed={TOPOLOGY.delay_exchange, TOPOLOGY.dead_exchange})
    settled = Settled(channel)
    await settled.settle(_message(channel), disposition)
    assert channel.frames == []  # redelivered later; nothing acked before it is durable
    assert settled.broker_failures == 1  # the session ends: the broker is failing


async def test_requeue_nacks_and_leave_does_nothing() -> None:
    channel = FakeChannel()
    settled = Settled(channel)
    await settled.settle(_message(channel), Requeue())
    await settled.settle(_message(channel), Leave())
    assert channel.frames == [("nack", 5, True)]


async def test_a_message_whose_channel_closed_is_left_to_the_broker() -> None:
    channel = FakeChannel(is_closed=True)
    settled = Settled(channel)
    for disposition in (Ack(), Redelay(amqp.BULK, 1.0), DeadLetter("poison"), Requeue()):
        await settled.settle(_message(channel), disposition)
    assert channel.frames == []  # no ack, no nack, no second copy
    assert settled.settler.left_to_broker == 4
