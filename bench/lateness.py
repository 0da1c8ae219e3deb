"""Lateness benchmark: how late does a reminder arrive, with a minutely CronJob?

Per run (fresh database and broker namespace, one ``relay consume``, the lean receiver):

1. load 60,000 one-shot reminders due evenly over 60 s (1,000/s, the *steady* part) and
   20,000 more all due at one instant 30 s after them (the *spike*);
2. run ``relay publish`` every 60 s as a CronJob would, each start delayed by a random
   0-5 s, with the default look-ahead (``RELAY_PUBLISH_LOOKAHEAD_SECONDS``): a run admits
   what falls due before the next run can, and each delivery reaches its lane at its due
   time through the broker's timer ladder;
3. when every row is delivered, read lateness from the ledger: the receiver's acceptance
   (``finished_at``) minus the occurrence's due time, per part.

Reported: each process's CPU over the run (RabbitMQ is ``beam.smp``, every PostgreSQL
backend ``postgres``, the publish runs ``publish<N>``); p50/p95/p99/max lateness of the
steady part, and per 5 s of its due time the worst lateness, the worst time from due to
the claim (the ladder, the lane and the consumer's intake), the most claims open at once
(next to the prefetch: is the consumer's window what holds messages back?) and the most
messages ready in the lanes (sampled every 0.25 s: waiting for the consumer, not in the
ladder); the consumer's own part after the claim (to the request, to the outcome
written); for the spike, its last delivery after the due instant against ``spike size /
drain rate + 2 s`` (the drain rate measured on the spike itself, between 10 % and 90 %
delivered).

    .venv/bin/python bench/lateness.py
    .venv/bin/python bench/lateness.py --steady 6000 --spike 2000   # a quick look
    .venv/bin/python bench/lateness.py --cpu-thief 0.35   # headroom: ~0.6 of the 2 cores taken

``--cpu-thief F`` starts one process per core that spins for F of every 20 ms and sleeps
the rest, at the same CPU priority as the relay, from the consumer's start to the end: a
slower or busier machine than this one, reproducibly (a host's steal cannot be asked for).

Targets (issue 17): steady p99 <= 2 s and p50 <= 0.5 s; spike last <= size / rate + 2 s.
Issue 30 raised the steady p99 to <= 1 s, with the publish run at the consumer's CPU
priority (the default here), and nothing early: no request started before its due time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aio_pika
import aiormq
import asyncpg
from _common import (
    AMQP_URL,
    RELAY,
    BenchEnv,
    CpuMonitor,
    bench_env,
    check,
    describe_groups,
    free_port,
    load_average,
    relay_variables,
    run_measured,
)
from drain import _spawn, _stop, _wait_port

from service import amqp, brokers
from service.settings import Settings

STEADY_SECONDS = 60.0
SPIKE_AFTER_SECONDS = 30.0  # after the steady part ends
LEAD_SECONDS = 25.0  # from the first run's start to the first due time
# One process per core: spin for ``duty`` of every 20 ms, sleep the rest.
THIEF = """
import sys, time
duty = float(sys.argv[1])
while True:
    end = time.perf_counter() + duty * 0.02
    while time.perf_counter() < end:
        pass
    time.sleep((1 - duty) * 0.02)
"""


def _write(path: Path, destination: str, steady: int, spike: int, first_due: datetime) -> None:
    spike_due = first_due + timedelta(seconds=STEADY_SECONDS + SPIKE_AFTER_SECONDS)
    with open(path, "w") as f:
        for i in range(steady + spike):
            due = (
                first_due + timedelta(seconds=STEADY_SECONDS * i / steady)
                if i < steady
                else spike_due
            )
            line = {
                "id": f"{'steady' if i < steady else 'spike'}-{i:06d}",
                "channel": "webhook",
                "destination": destination,
                "payload": {"n": i},
                "due_at": due.isoformat(),
            }
            f.write(json.dumps(line) + "\n")


def _percentile(values: list[float], share: float) -> float:
    return values[min(len(values) - 1, int(len(values) * share))]


async def _cron(
    env: BenchEnv,
    stop: asyncio.Event,
    rng: random.Random,
    first_due: datetime,
    monitor: CpuMonitor,
    nice: int = 0,
) -> list[str]:
    """``relay publish`` every 60 s from now, each start 0-5 s late, until ``stop``; with
    ``nice`` > 0 at a lower CPU priority than the consumer (as separate pods with their own
    CPU would be: on this 2-core machine the run competes with the consumer it feeds)."""
    command = [*(["nice", "-n", str(nice)] if nice > 0 else []), *RELAY, "publish"]
    runs: list[str] = []
    tick = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(max(0.0, tick - time.monotonic()) + rng.uniform(0, 5))
        started = (datetime.now(UTC) - first_due).total_seconds()
        result = await asyncio.to_thread(
            run_measured, command, env.env(), env.scratch, f"publish{len(runs)}", monitor
        )
        check(result, "relay publish")
        took = (
            f"{result.wall_seconds:.1f} s from {started:+.1f} s after the first due time, "
            f"{result.cpu_seconds:.1f} CPU-s"
        )
        runs.append(f"{result.stdout.strip()} ({took})")
        tick += 60.0
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, tick - time.monotonic()))
        except TimeoutError:
            pass
    return runs


async def _sample_lanes(namespace: str, stop: asyncio.Event) -> list[tuple[datetime, int]]:
    """Messages ready in the lanes (delivered by the broker to no consumer yet), every
    0.25 s until ``stop``: beside the time from due to the claim, it says whether a late
    message waited in a lane for the consumer to take it, or upstream in the ladder."""
    topology = amqp.Topology.from_settings(Settings(amqp_namespace=namespace))
    lanes = [topology.lane_queue(lane) for lane in (amqp.BULK, amqp.URGENT)]
    samples: list[tuple[datetime, int]] = []
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        while not stop.is_set():
            try:
                ready = await brokers.ready_total(connection, lanes, timeout_seconds=5.0)
            except aiormq.exceptions.ChannelNotFoundEntity:
                pass  # the consumer has not declared its lanes yet
            else:
                samples.append((datetime.now(UTC), ready))
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except TimeoutError:
                pass
    return samples


def _by_due_time(
    rows: list[asyncpg.Record], lanes: list[tuple[datetime, int]], width: float = 5.0
) -> None:
    """Where in the steady minute the lateness is: the max per ``width`` seconds of due
    time, and how much of it had passed when the row was claimed (the broker's part and
    the consumer's intake, against its request and outcome after the claim)."""
    start = min(r["occurrence_at"] for r in rows)
    worst: dict[int, float] = {}
    worst_claim: dict[int, float] = {}
    for r in rows:
        bucket = int((r["occurrence_at"] - start).total_seconds() // width)
        worst[bucket] = max(worst.get(bucket, 0.0), r["late"])
        worst_claim[bucket] = max(worst_claim.get(bucket, 0.0), r["to_claim"])
    cells = " ".join(f"{worst[b]:.1f}" for b in sorted(worst))
    print(f"   steady max lateness per {width:.0f} s of due time: {cells}")
    cells = " ".join(f"{worst_claim[b]:.1f}" for b in sorted(worst_claim))
    print(f"   steady max time from due to claim, the same buckets: {cells}")
    # Claims open at once (claimed, outcome not yet written), by when: near the prefetch,
    # the consumer's window and not the broker holds the next messages back.
    events = sorted(
        [(r["occurrence_at"] + timedelta(seconds=r["to_claim"]), 1) for r in rows]
        + [(r["finished_at"], -1) for r in rows]
    )
    open_now, most = 0, dict[int, int]()
    for at, step in events:
        open_now += step
        bucket = int((at - start).total_seconds() // width)
        most[bucket] = max(most.get(bucket, 0), open_now)
    cells = " ".join(str(most[b]) for b in sorted(most) if b in worst)
    print(f"   steady claims open at once (max), by when, the same buckets: {cells}")
    ready = dict[int, int]()
    for at, count in lanes:
        bucket = int((at - start).total_seconds() // width)
        ready[bucket] = max(ready.get(bucket, 0), count)
    cells = " ".join(str(ready.get(b, "-")) for b in sorted(worst))
    print(f"   ready in the lanes, not yet taken by the consumer (max), by when: {cells}")


async def _report(
    pool: asyncpg.Pool, steady: int, spike: int, lanes: list[tuple[datetime, int]]
) -> None:
    rows = await pool.fetch(
        "SELECT reminder_id, extract(epoch FROM finished_at - occurrence_at)::float8 AS late,"
        " extract(epoch FROM first_attempt_at - occurrence_at)::float8 AS to_claim,"
        " finished_at, occurrence_at FROM deliveries WHERE state = 'delivered'"
    )
    # Early: a request started before its due time (the first attempt's start, not the
    # acceptance, which comes later).
    early = await pool.fetchval(
        "SELECT count(*) FROM deliveries AS d JOIN delivery_attempts AS a"
        " ON a.delivery_id = d.id WHERE a.started_at < d.occurrence_at"
    )
    verdict = "met" if not early else "MISSED"
    print(f"early (a request started before its due time): {early} ({verdict})")
    # After the claim, the consumer's own part: to the request, and to the outcome written.
    parts = await pool.fetchrow(
        "SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY"
        "   extract(epoch FROM a.started_at - d.first_attempt_at)) AS to_request,"
        " percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY"
        "   extract(epoch FROM d.finished_at - a.started_at)) AS to_outcome"
        " FROM deliveries AS d JOIN delivery_attempts AS a ON a.delivery_id = d.id"
        " WHERE d.state = 'delivered' AND d.reminder_id LIKE 'steady%'"
    )
    if parts is not None and parts["to_request"] is not None:
        (c50, c99), (o50, o99) = parts["to_request"], parts["to_outcome"]
        print(
            f"   steady, claim to request: p50 {c50:.3f} s, p99 {c99:.3f} s; request to "
            f"outcome written: p50 {o50:.3f} s, p99 {o99:.3f} s"
        )
    steady_rows = [r for r in rows if r["reminder_id"].startswith("steady")]
    steady_late = sorted(r["late"] for r in steady_rows)
    spike_rows = [r for r in rows if r["reminder_id"].startswith("spike")]
    spike_rows.sort(key=lambda r: r["finished_at"])
    if steady_late:
        p50, p95 = _percentile(steady_late, 0.5), _percentile(steady_late, 0.95)
        p99 = _percentile(steady_late, 0.99)
        verdict = "met" if p50 <= 0.5 and p99 <= 2.0 else "MISSED"
        raised = "met" if p99 <= 1.0 else "MISSED"
        print(
            f"steady ({len(steady_late)} of {steady}): p50 {p50:.3f} s, p95 {p95:.3f} s, "
            f"p99 {p99:.3f} s, max {steady_late[-1]:.3f} s (issue 17, p50 <= 0.5 and "
            f"p99 <= 2: {verdict}; issue 30, p99 <= 1: {raised})"
        )
        _by_due_time(steady_rows, lanes)
    if spike_rows:
        a, b = spike_rows[len(spike_rows) // 10], spike_rows[len(spike_rows) * 9 // 10]
        span = max((b["finished_at"] - a["finished_at"]).total_seconds(), 1e-6)
        rate = len(spike_rows) * 0.8 / span
        last, bound = spike_rows[-1]["late"], spike / rate + 2.0
        verdict = "met" if last <= bound else "MISSED"
        print(
            f"spike ({len(spike_rows)} of {spike}): last delivery {last:.2f} s after due; "
            f"drain rate {rate:.0f}/s, size / rate + 2 = {bound:.2f} s ({verdict}); "
            f"median {spike_rows[len(spike_rows) // 2]['late']:.2f} s"
        )
        print(
            f"   spike lateness at the first, 10 %, 90 % and last delivery: "
            f"{spike_rows[0]['late']:.2f}, {a['late']:.2f}, {b['late']:.2f}, {last:.2f} s"
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steady", type=int, default=60_000)
    parser.add_argument("--spike", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--publisher-nice", type=int, default=0, help="run relay publish under nice -n N"
    )
    parser.add_argument(
        "--cpu-thief",
        type=float,
        default=0.0,
        metavar="F",
        help="one process per core busy F (0-0.9) of the time, at equal priority",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra setting for the consumer and the publish runs, e.g. prefetch=1000 "
        "(RELAY_ prefix added)",
    )
    args = parser.parse_args()
    if not 0.0 <= args.cpu_thief <= 0.9:
        parser.error("--cpu-thief must be between 0 and 0.9")
    print(f"lateness: {args.steady} steady over 60 s + {args.spike} at once; load {load_average()}")
    async with bench_env("lateness", keep_scratch=args.keep_logs) as env:
        env.extra_env.update(relay_variables(dict(kv.split("=", 1) for kv in args.env)))
        port = free_port()
        receiver = [sys.executable, str(Path(__file__).with_name("receiver.py"))]
        partner = _spawn([*receiver, "--port", str(port)], env.env(), env.scratch / "partner.log")
        consumer: subprocess.Popen[bytes] | None = None
        thieves: list[subprocess.Popen[bytes]] = []
        sampler: asyncio.Task[list[tuple[datetime, int]]] | None = None
        stop = asyncio.Event()
        try:
            await _wait_port(port, partner)
            path = env.scratch / "reminders.jsonl"
            # Due times leave room for loading the file first (~10 s for 80,000 lines).
            first_due = datetime.now(UTC) + timedelta(seconds=LEAD_SECONDS + 20)
            _write(path, f"http://127.0.0.1:{port}/hooks/bench", args.steady, args.spike, first_due)
            load = [*RELAY, "reminders", "load", str(path)]
            loaded = run_measured(load, env.env(), env.scratch, "load")
            check(loaded, "relay reminders load")
            lead = (first_due - datetime.now(UTC)).total_seconds()
            print(f"   loaded in {loaded.wall_seconds:.1f} s; first due in {lead:.1f} s")
            monitor = CpuMonitor().start()
            monitor.ours[partner.pid] = "receiver"
            consumer = _spawn([*RELAY, "consume"], env.env(), env.scratch / "consumer.log")
            monitor.ours[consumer.pid] = "relay consume"
            for n in range(os.cpu_count() or 1) if args.cpu_thief else ():
                spin = [sys.executable, "-c", THIEF, str(args.cpu_thief)]
                thief = _spawn(spin, env.env(), env.scratch / f"thief{n}.log")
                thieves.append(thief)
                monitor.ours[thief.pid] = "cpu thief"
            sampler = asyncio.create_task(_sample_lanes(env.namespace, stop))
            rng = random.Random(args.seed)
            cron = asyncio.create_task(
                _cron(env, stop, rng, first_due, monitor, args.publisher_nice)
            )
            pool = await asyncpg.create_pool(env.database_url, min_size=1, max_size=2)
            total = args.steady + args.spike
            deadline = time.monotonic() + STEADY_SECONDS + SPIKE_AFTER_SECONDS + 240
            while time.monotonic() < deadline:
                done = await pool.fetchval(
                    "SELECT count(*) FROM deliveries WHERE state = 'delivered'"
                )
                if done == total:
                    break
                await asyncio.sleep(1.0)
            stop.set()
            for line in await cron:
                print(f"   publish: {line}")
            groups = monitor.stop()
            print(f"   CPU over {monitor.wall:.0f} s: {describe_groups(groups, monitor.wall, 8)}")
            await _report(pool, args.steady, args.spike, await sampler)
            await pool.close()
        finally:
            stop.set()
            if sampler is not None and not sampler.done():
                sampler.cancel()
            if consumer is not None:
                _stop(consumer)
            for thief in thieves:
                thief.kill()
                thief.wait()
            _stop(partner)


if __name__ == "__main__":
    asyncio.run(main())
