"""Grouped acknowledgements: which frames go out, and that none acknowledges a message
that is still being worked. The frames are recorded, not sent (a pure unit test); the
pipeline tests run the same code against a real broker."""

from __future__ import annotations

import asyncio

from consumer.acks import GroupedAcks


class Frames:
    def __init__(self) -> None:
        self.sent: list[tuple[int, bool]] = []

    async def send(self, tag: int, multiple: bool) -> None:
        self.sent.append((tag, multiple))


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_messages_settled_in_one_tick_in_order_go_out_as_one_multiple_ack() -> None:
    frames = Frames()
    acks = GroupedAcks(frames.send)
    for tag in range(1, 6):
        acks.opened(tag)
    for tag in range(1, 6):
        acks.ack(tag)
    await _settle()
    assert frames.sent == [(5, True)]


async def test_a_message_still_worked_holds_the_run_back_and_those_past_it_go_one_by_one() -> None:
    frames = Frames()
    acks = GroupedAcks(frames.send)
    for tag in range(1, 6):
        acks.opened(tag)
    for tag in (1, 2, 4, 5):  # 3 is still waiting for its receiver
        acks.ack(tag)
    await _settle()
    assert frames.sent == [(2, True), (4, False), (5, False)]
    acks.ack(3)
    await _settle()
    assert frames.sent[-1] == (3, True)  # 4 and 5 are acked already: only 3 remains


async def test_a_nacked_message_does_not_hold_the_run_back() -> None:
    frames = Frames()
    acks = GroupedAcks(frames.send)
    for tag in range(1, 4):
        acks.opened(tag)
    acks.dropped(2)  # nacked through the message itself
    acks.ack(1)
    acks.ack(3)
    await _settle()
    assert frames.sent == [(3, True)]


async def test_messages_settled_in_later_ticks_each_go_out_with_their_own_group() -> None:
    frames = Frames()
    acks = GroupedAcks(frames.send)
    for tag in range(1, 5):
        acks.opened(tag)
    acks.ack(1)
    acks.ack(2)
    await _settle()
    acks.ack(3)
    acks.ack(4)
    await _settle()
    assert frames.sent == [(2, True), (4, True)]
