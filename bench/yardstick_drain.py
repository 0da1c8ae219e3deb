"""Yardstick for the drain benchmark: ``relay consume`` against a minimal hand-written
consumer (``bench/yardstick_consumer.py``) on identically prepared data.

Each side, in alternating order per pair (yardstick first in odd pairs, relay first in
even ones), gets a fresh database ``relay_bench_drain_*`` and broker namespace, the lean
receiver (``bench/receiver.py``) and N webhook reminders loaded and queued by ``relay
reminders load`` + ``relay publish`` (``drain._prepare``), so the queued messages and the
ledger rows are exactly what the relay makes. Then:

- yardstick: ``bench/yardstick_consumer.py`` in its own process (aio-pika, one SELECT and
  one UPDATE per batch, signed POSTs through one aiohttp session, one multiple-ack per
  batch; no leases, no attempt rows, no metrics), measured the way ``drain.py`` measures;
- relay: ``drain.one_run``, i.e. ``relay consume`` exactly as ``bench/drain.py`` runs it
  (its own line of figures is printed as well).

Reported per side: wall time (consumer start to N delivered in the ledger), deliveries/s
overall and steady (10-90 % delivered), consumer CPU per delivery (steady, from /proc),
the receiver's counts (logical events == N, duplicates 0, bad signatures 0, else the run
fails). Summary: relay/yardstick steady deliveries/s per pair, median and min-max, and
the steady CPU per delivery of both.

    .venv/bin/python bench/yardstick_drain.py                       # 10,000, 3 pairs
    .venv/bin/python bench/yardstick_drain.py --count 300 --pairs 1 # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import asyncpg
import drain
from _common import (
    AMQP_URL,
    CpuMonitor,
    bench_env,
    describe_groups,
    free_port,
    load_average,
    median,
    proc_cpu_seconds,
    proc_status_kb,
    state_counts,
)

from service import amqp
from service.settings import Settings

HERE = Path(__file__).resolve().parent


@dataclass
class Side:
    name: str
    count: int
    wall_seconds: float
    steady_rate: float
    steady_cpu_ms: float  # consumer CPU per delivery between 10 % and 90 % delivered
    cpu_ms: float  # consumer CPU per delivery over the whole run (start-up included)
    peak_rss_mb: float
    receiver: dict[str, object]

    @property
    def rate(self) -> float:
        return self.count / self.wall_seconds


def _steady(samples: list[tuple[float, int, float]], count: int) -> tuple[float, float]:
    """(deliveries/s, CPU ms per delivery) between 10 % and 90 % delivered, as drain.py."""

    def at(fraction: float) -> tuple[float, int, float]:
        return next(s for s in samples if s[1] >= count * fraction)

    (t10, n10, cpu10), (t90, n90, cpu90) = at(0.1), at(0.9)
    if t90 <= t10 or n90 <= n10:
        return float("nan"), float("nan")
    return (n90 - n10) / (t90 - t10), (cpu90 - cpu10) / (n90 - n10) * 1e3


def _verify(side: Side, delivered: int | None = None) -> None:
    """Fail loudly unless the receiver counted every event once, every signature good."""
    stats = side.receiver
    problems = [
        f"{name} {stats.get(name)} (expected {want})"
        for name, want in (("logical_events", side.count), ("duplicates", 0), ("bad_signatures", 0))
        if stats.get(name) != want
    ]
    if delivered is not None and delivered != side.count:
        problems.append(f"ledger delivered {delivered} (expected {side.count})")
    if problems:
        raise SystemExit(f"{side.name}: " + "; ".join(problems) + f" | receiver {stats}")


async def yardstick_run(args: argparse.Namespace, number: int) -> Side:
    async with bench_env("drain", keep_scratch=args.keep_logs) as env:
        port = free_port()
        receiver_cmd = [sys.executable, str(HERE / "receiver.py"), "--port", str(port)]
        receiver = drain._spawn(receiver_cmd, env.env(), env.scratch / "partner.log")
        consumer: subprocess.Popen[bytes] | None = None
        try:
            await drain._wait_port(port, receiver)
            await drain._prepare(args, env, port)
            topology = amqp.Topology.from_settings(Settings(amqp_namespace=env.namespace))
            command = [
                sys.executable,
                str(HERE / "yardstick_consumer.py"),
                *("--dsn", env.database_url, "--amqp-url", AMQP_URL),
                *("--queue", topology.lane_queue(amqp.BULK)),
                *("--prefetch", str(args.prefetch), "--batch", str(args.write_batch)),
                *("--connections", str(args.connections), "--pool-size", str(args.pool_size)),
            ]
            log = env.scratch / "yardstick.log"
            pool = await asyncpg.create_pool(env.database_url, min_size=1, max_size=1)
            try:
                monitor = CpuMonitor().start()
                monitor.ours[receiver.pid] = "partner"
                started = time.monotonic()
                consumer = drain._spawn(command, env.env(), log)
                monitor.ours[consumer.pid] = "yardstick"
                samples: list[tuple[float, int, float]] = []  # (seconds, delivered, CPU)
                delivered = 0
                while delivered < args.count:
                    if consumer.poll() is not None:
                        tail = log.read_text(errors="replace")[-2000:]
                        raise SystemExit(f"yardstick exited {consumer.returncode} early\n{tail}")
                    if time.monotonic() - started > args.timeout:
                        raise SystemExit(f"yardstick timed out: {await state_counts(pool)}")
                    delivered = int(
                        await pool.fetchval(
                            "SELECT count(*) FROM deliveries WHERE state = 'delivered'"
                        )
                    )
                    cpu = proc_cpu_seconds(consumer.pid) or 0.0
                    samples.append((time.monotonic() - started, delivered, cpu))
                    if delivered < args.count:
                        await asyncio.sleep(args.poll)
                wall = time.monotonic() - started
                groups = monitor.stop()
                peak_kb = proc_status_kb(consumer.pid, "VmHWM") or 0
                states = await state_counts(pool)
            finally:
                await pool.close()
            code = drain._stop(consumer)
            stats = await drain._partner_stats(port)
        finally:
            if consumer is not None:
                drain._stop(consumer)
            drain._stop(receiver)
    steady_rate, steady_cpu_ms = _steady(samples, args.count)
    side = Side(
        name="yardstick",
        count=args.count,
        wall_seconds=wall,
        steady_rate=steady_rate,
        steady_cpu_ms=steady_cpu_ms,
        cpu_ms=samples[-1][2] / args.count * 1e3,
        peak_rss_mb=peak_kb / 1024,
        receiver=stats,
    )
    print(
        f"yardstick {number}: {wall:6.2f} s -> {side.rate:6.0f} deliveries/s (steady 10-90 %: "
        f"{steady_rate:6.0f}/s) | CPU {side.cpu_ms:.3f} ms/delivery (steady {steady_cpu_ms:.3f})"
        f" | peak RSS {side.peak_rss_mb:.1f} MB | exit {code} | ledger {states} | "
        f"receiver {stats}\n"
        f"   CPU during the drain, all processes: {describe_groups(groups, wall)}",
        flush=True,
    )
    _verify(side, states.get("delivered"))
    if code != 0:
        raise SystemExit(f"yardstick exited {code} on SIGTERM")
    return side


async def relay_run(args: argparse.Namespace, number: int) -> Side:
    """``relay consume`` exactly as ``bench/drain.py`` runs it (its defaults otherwise)."""
    drain_args = argparse.Namespace(
        count=args.count,
        prefetch=args.prefetch,
        pool_size=args.pool_size,
        write_batch=args.write_batch,
        log_level=args.log_level,
        env=[],
        receiver="lean",
        poll=args.poll,
        timeout=args.timeout,
        profile="",
        cprofile="",
        keep_logs=args.keep_logs,
    )
    run = await drain.one_run(drain_args, number)  # checks ledger, events, signatures
    side = Side(
        name="relay",
        count=run.count,
        wall_seconds=run.wall_seconds,
        steady_rate=run.steady_rate,
        steady_cpu_ms=run.steady_cpu_us / 1e3,
        cpu_ms=run.cpu_us_per_delivery / 1e3,
        peak_rss_mb=run.peak_rss_mb,
        receiver=run.partner,
    )
    _verify(side)
    return side


def _table(number: int, sides: list[Side]) -> str:
    lines = [
        f"-- pair {number} ({' then '.join(s.name for s in sides)}), {sides[0].count} deliveries",
        f"   {'':10} {'wall s':>7} {'deliv/s':>8} {'steady/s':>9} {'CPU ms/deliv':>13} "
        f"{'(whole run)':>11} {'RSS MB':>7}  receiver events/dup/bad",
    ]
    for s in sorted(sides, key=lambda s: s.name != "yardstick"):
        r = s.receiver
        lines.append(
            f"   {s.name:10} {s.wall_seconds:7.2f} {s.rate:8.0f} {s.steady_rate:9.0f} "
            f"{s.steady_cpu_ms:13.3f} {s.cpu_ms:11.3f} {s.peak_rss_mb:7.1f}  "
            f"{r.get('logical_events')}/{r.get('duplicates')}/{r.get('bad_signatures')}"
        )
    yard, relay = sorted(sides, key=lambda s: s.name != "yardstick")
    rate, cpu = (
        _ratio(relay.steady_rate, yard.steady_rate),
        _ratio(relay.steady_cpu_ms, yard.steady_cpu_ms),
    )
    lines.append(
        f"   relay/yardstick: steady deliveries/s x{rate:.2f}, steady CPU per delivery x{cpu:.2f}"
    )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _spread(values: list[float], fmt: str) -> str:
    return f"median {median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--count", type=int, default=10_000, help="queued deliveries (10000)")
    parser.add_argument("--pairs", type=int, default=3, help="yardstick/relay pairs (3)")
    parser.add_argument("--prefetch", type=int, default=500, help="both consumers (500)")
    parser.add_argument(
        "--write-batch", type=int, default=200, help="RELAY_WRITE_BATCH_MAX; yardstick batch"
    )
    parser.add_argument("--pool-size", type=int, default=10, help="database pool, both (10)")
    parser.add_argument(
        "--connections",
        type=int,
        default=0,
        help="yardstick's connections to the receiver (default: the relay's destination "
        "share, prefetch x RELAY_DESTINATION_MAX_SHARE)",
    )
    parser.add_argument("--log-level", default="INFO", help="relay RELAY_LOG_LEVEL (INFO)")
    parser.add_argument("--poll", type=float, default=0.1, help="ledger poll interval (s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after (s)")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    if args.connections <= 0:
        # the field's default, as relay consume gets it (drain.py passes no RELAY_* of ours)
        share = Settings.model_fields["destination_max_share"].default
        args.connections = max(1, int(args.prefetch * share))
    print(
        f"== drain yardstick: {args.count} queued webhook deliveries, {args.pairs} pair(s), "
        f"prefetch {args.prefetch}, batch {args.write_batch}, pool {args.pool_size}, "
        f"yardstick connections {args.connections}; load average {load_average()}; "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    pairs: list[list[Side]] = []
    for number in range(1, args.pairs + 1):
        order = [yardstick_run, relay_run] if number % 2 else [relay_run, yardstick_run]
        pairs.append([await run(args, number) for run in order])
        print(_table(number, pairs[-1]), flush=True)
    yards = [next(s for s in pair if s.name == "yardstick") for pair in pairs]
    relays = [next(s for s in pair if s.name == "relay") for pair in pairs]
    ratios = [_ratio(r.steady_rate, y.steady_rate) for r, y in zip(relays, yards, strict=True)]
    cpu_ratios = [
        _ratio(r.steady_cpu_ms, y.steady_cpu_ms) for r, y in zip(relays, yards, strict=True)
    ]
    print(
        f"== summary of {len(pairs)} pair(s), {args.count} deliveries each\n"
        f"   relay/yardstick steady deliveries/s: {_spread(ratios, '.2f')} "
        f"[{', '.join(f'{x:.2f}' for x in ratios)}]\n"
        f"   steady deliveries/s: relay {_spread([r.steady_rate for r in relays], '.0f')}, "
        f"yardstick {_spread([y.steady_rate for y in yards], '.0f')}\n"
        f"   steady CPU ms/delivery: relay {_spread([r.steady_cpu_ms for r in relays], '.3f')}, "
        f"yardstick {_spread([y.steady_cpu_ms for y in yards], '.3f')}; "
        f"relay/yardstick {_spread(cpu_ratios, '.2f')}\n"
        f"   load average now {load_average()}",
        flush=True,
    )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
