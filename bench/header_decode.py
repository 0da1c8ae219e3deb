"""What a delivery's header frame costs the consumer to decode, by how it reached the lane.

A delivery published for now reaches the lane queue with one header (the run's trace
context). One handed to the timer ladder (``service/timer.py``) also carries a routing
header per level from its entry level down, and RabbitMQ adds an ``x-death`` entry for
every level it waited in (a table of six fields: count, reason, queue, time, exchange,
routing keys) plus three ``x-first-death-*`` headers. aiormq decodes every header frame
with pamqp, in Python, before the consumer sees the message, whether or not the consumer
reads those headers (it reads none of them).

Per wait: the header frame the consumer receives (its size, its x-death entries), built as
RabbitMQ 3.10 writes it (the shape checked against a message dead-lettered through three
TTL queues), and the CPU time of ``pamqp.frame.unmarshal`` on it, the call aiormq makes.
No server needed.

    .venv/bin/python bench/header_decode.py
    .venv/bin/python bench/header_decode.py --wait 0 1.55 74.95 --count 50000
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pamqp import frame, header
from pamqp.commands import Basic
from yardstick_publisher import TRACE_HEADER  # the relay's trace header, as published

from service import timer

NAMESPACE = "relay-0123abcd"  # as long as a real namespace


def delivered_headers(wait_seconds: float) -> dict[str, object]:
    """The headers of a delivery that waited ``wait_seconds`` in the ladder (0: none)."""
    headers: dict[str, object] = dict(TRACE_HEADER)
    if wait_seconds <= 0:
        return headers
    entry, routing = timer.route(NAMESPACE, wait_seconds)
    headers.update(routing)
    wait = timer.digits(timer.units_for(wait_seconds))
    waited = [(level, digit) for level, digit in enumerate(wait) if digit]  # lowest first
    now = datetime.now(UTC).replace(microsecond=0)
    headers["x-death"] = [  # the broker puts the latest dead-lettering (the lowest) first
        {
            "count": 1,
            "reason": "expired",
            "queue": timer.queue_name(NAMESPACE, level, digit),
            "time": now,
            "exchange": timer.exchange_name(NAMESPACE, level),
            "routing-keys": ["bulk"],
        }
        for level, digit in waited
    ]
    headers["x-first-death-exchange"] = entry
    headers["x-first-death-queue"] = timer.queue_name(NAMESPACE, *waited[-1])
    headers["x-first-death-reason"] = "expired"
    return headers


def header_frame(headers: dict[str, object]) -> bytes:
    properties = Basic.Properties(
        content_type="application/json",
        delivery_mode=2,
        headers=headers,
        message_id="relay-1",
    )
    return frame.marshal(header.ContentHeader(0, 30, properties), 1)


def decode_micros(raw: bytes, count: int) -> float:
    started = time.process_time()
    for _ in range(count):
        frame.unmarshal(raw)
    return (time.process_time() - started) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--wait",
        type=float,
        nargs="+",
        default=[0.0, 0.35, 3.15, 37.35, 74.95],
        help="ladder waits (s) to measure; 0: published for now",
    )
    parser.add_argument("--count", type=int, default=20_000, help="decodes per wait")
    args = parser.parse_args()
    base = None
    for wait in args.wait:
        headers = delivered_headers(wait)
        raw = header_frame(headers)
        micros = decode_micros(raw, args.count)
        base = micros if base is None else base
        deaths = headers.get("x-death")
        entries = len(deaths) if isinstance(deaths, list) else 0
        print(
            f"wait {wait:6.2f} s: {len(headers) - 1:2d} headers besides the trace, "
            f"{entries:2d} x-death entries, frame {len(raw):5d} bytes: "
            f"{micros:6.1f} us to decode ({micros - base:+6.1f} us against the first)"
        )


if __name__ == "__main__":
    main()
