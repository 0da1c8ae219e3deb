"""Drain benchmark: N queued webhook deliveries -> ONE ``relay consume`` process.

Per run (fresh database ``relay_bench_drain_*`` and broker namespace ``bench-*``):

1. start a receiver in its own process, verifying the Standard Webhooks signature of
   every request (``RELAY_WEBHOOK_SIGNING_SECRETS``) and counting logical events by
   idempotency key: ``bench/receiver.py`` (default: a partner on another machine costs
   this machine nothing, so the stand-in costs as little as it can) or, with
   ``--receiver partner``, the demo partner (``relay partner``, ~4x its CPU);
2. load N one-shot reminders due now (``relay reminders load``) and queue them
   (``relay publish``): N rows ``queued``, N messages on the quorum work queue;
3. start one ``relay consume`` (``RELAY_HEALTH_PORT=0``) and poll the ledger until all
   N rows are ``delivered``; then read the consumer's peak RSS (VmHWM) and CPU time
   (utime + stime) from /proc before sending SIGTERM.

Reported: wall time from consumer start to N delivered, deliveries/s (overall and
steady-state between 10 % and 90 % delivered), time to the first delivery, consumer
peak RSS, consumer CPU per delivery, the partner's CPU, how busy the whole machine was,
and the partner's counts (logical events, duplicates, bad signatures).

    .venv/bin/python bench/drain.py --runs 3
    .venv/bin/python bench/drain.py --count 20000 --prefetch 500 --pool-size 10 --write-batch 200
    .venv/bin/python bench/drain.py --runs 1 --profile /tmp/drain   # py-spy raw stacks

CPU per delivery is printed twice: over the whole run (start-up included: imports and
connections, ~0.7 s that does not grow with N) and between 10 % and 90 % delivered (what
one more delivery costs).

Targets (issues): >= 2,000 deliveries/s with one consumer process, peak RSS < 150 MB,
<= 350 us of consumer CPU per delivery.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import asyncpg
from _common import (
    RELAY,
    REPO,
    BenchEnv,
    CpuCap,
    CpuMonitor,
    MachineLoad,
    bench_env,
    check,
    describe_groups,
    free_port,
    load_average,
    median,
    proc_cpu_seconds,
    proc_status_kb,
    queue_depth,
    run_measured,
    state_counts,
    write_reminders,
)

TARGET_RATE = 2000.0
TARGET_RSS_MB = 150.0
TARGET_CPU_US = 350.0  # per delivery (issue 17)


@dataclass
class DrainRun:
    count: int
    wall_seconds: float
    first_delivery_seconds: float
    steady_rate: float
    peak_rss_mb: float
    cpu_seconds: float
    startup_cpu_seconds: float  # the consumer's CPU before its first delivery
    steady_cpu_us: float  # CPU per delivery between 10 % and 90 % delivered
    partner_cpu_seconds: float
    machine_busy: float
    cpu_groups: dict[str, float]
    consumer_runnable: float
    partner: dict[str, object]

    @property
    def rate(self) -> float:
        return self.count / self.wall_seconds

    @property
    def cpu_us_per_delivery(self) -> float:
        return self.cpu_seconds / self.count * 1e6


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as err:
        return subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )


def _profile(pid: int, out: str) -> subprocess.Popen[bytes]:
    """py-spy sampling the consumer (raw collapsed stacks), until SIGINT."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    cmd = [py_spy, "record", "--nonblocking", "-r", "200", "-f", "raw", "-o", out]
    return subprocess.Popen(
        [*cmd, "--pid", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


async def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"partner exited {proc.returncode}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return
    raise SystemExit(f"partner not listening on {port} after {timeout} s")


def _log_summary(path: Path) -> str:
    """Events of the consumer's JSON log (at INFO): deferrals, redelays, HTTP latency."""
    events: dict[str, int] = {}
    latencies: list[float] = []
    with open(path, errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            event = str(record.get("event", "?"))
            events[event] = events.get(event, 0) + 1
            if event == "attempt" and isinstance(record.get("latency_ms"), int | float):
                latencies.append(float(record["latency_ms"]))
    latencies.sort()
    text = ", ".join(f"{k} {v}" for k, v in sorted(events.items()))
    if latencies:
        text += (
            f"; send latency ms median {latencies[len(latencies) // 2]:.1f} "
            f"p90 {latencies[int(len(latencies) * 0.9)]:.1f}"
        )
    return text or "(nothing logged at this level)"


async def _partner_stats(port: int) -> dict[str, object]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/stats") as response,
    ):
        stats: dict[str, object] = json.loads(await response.text())
        return stats


async def _prepare(args: argparse.Namespace, env: BenchEnv, port: int) -> None:
    path = env.scratch / "reminders.jsonl"
    write_reminders(path, args.count, f"http://127.0.0.1:{port}/hooks/bench")
    loaded = run_measured([*RELAY, "reminders", "load", str(path)], env.env(), env.scratch, "load")
    check(loaded, "relay reminders load")
    published = run_measured([*RELAY, "publish"], env.env(), env.scratch, "publish")
    check(published, "relay publish")
    depth = await queue_depth(env.namespace)
    print(
        f"   prepared: load {loaded.wall_seconds:.1f} s, publish {published.wall_seconds:.1f} s "
        f"({published.stdout.strip()}); {depth} messages queued",
        flush=True,
    )
    if depth != args.count:
        raise SystemExit(f"expected {args.count} queued messages, found {depth}")


async def one_run(args: argparse.Namespace, number: int, cap: CpuCap | None = None) -> DrainRun:
    async with bench_env("drain", keep_scratch=args.keep_logs) as env:
        port = free_port()
        receiver = (
            [sys.executable, str(Path(__file__).with_name("receiver.py"))]
            if args.receiver == "lean"
            else [*RELAY, "partner"]
        )
        partner = _spawn([*receiver, "--port", str(port)], env.env(), env.scratch / "partner.log")
        profiler: subprocess.Popen[bytes] | None = None
        consumer: subprocess.Popen[bytes] | None = None
        try:
            await _wait_port(port, partner)
            await _prepare(args, env, port)
            pool = await asyncpg.create_pool(env.database_url, min_size=1, max_size=1)
            consumer_env = env.env(
                prefetch=str(args.prefetch),
                database_pool_size=str(args.pool_size),
                write_batch_max=str(args.write_batch),
                log_level=args.log_level,
                **dict(kv.split("=", 1) for kv in args.env),
            )
            partner_cpu0 = proc_cpu_seconds(partner.pid) or 0.0
            load = MachineLoad()
            monitor = CpuMonitor().start()
            monitor.ours[partner.pid] = "partner"
            command = [*RELAY, "consume"]
            if args.cprofile:
                wrapper = str(Path(__file__).resolve().parent / "cprofile_relay.py")
                command = [sys.executable, wrapper, f"{args.cprofile}.{number}.prof", "consume"]
            started = time.monotonic()
            consumer = _spawn(command, consumer_env, env.scratch / "consumer.log")
            if cap is not None:
                cap.add(consumer.pid)  # at once, during its start-up: the steady part is all capped
            monitor.ours[consumer.pid] = "consumer"
            if args.profile:
                profiler = _profile(consumer.pid, f"{args.profile}.{number}.txt")
            samples: list[tuple[float, int, float]] = []  # (seconds, delivered, consumer CPU)
            deadline = started + args.timeout
            delivered = 0
            try:
                while delivered < args.count:
                    if consumer.poll() is not None:
                        raise SystemExit(f"consumer exited {consumer.returncode} early")
                    if time.monotonic() > deadline:
                        raise SystemExit(
                            f"timed out after {args.timeout} s: {delivered} delivered, "
                            f"ledger {await state_counts(pool)}"
                        )
                    delivered = int(
                        await pool.fetchval(
                            "SELECT count(*) FROM deliveries WHERE state = 'delivered'"
                        )
                    )
                    elapsed = time.monotonic() - started
                    samples.append((elapsed, delivered, proc_cpu_seconds(consumer.pid) or 0.0))
                    if delivered < args.count:
                        await asyncio.sleep(args.poll)
                wall = time.monotonic() - started
                busy = load.stop()
                groups = monitor.stop()
                peak_kb = proc_status_kb(consumer.pid, "VmHWM") or 0
                cpu = proc_cpu_seconds(consumer.pid) or 0.0
                partner_cpu = (proc_cpu_seconds(partner.pid) or 0.0) - partner_cpu0
                states = await state_counts(pool)
            finally:
                await pool.close()
            if profiler is not None:
                _stop(profiler, signal.SIGINT)
            code = _stop(consumer)
            stats = await _partner_stats(port)
        finally:
            if profiler is not None:
                _stop(profiler, signal.SIGINT)
            if consumer is not None:
                _stop(consumer)
            _stop(partner)

        def at(fraction: float) -> tuple[float, int, float]:
            goal = args.count * fraction
            return next(sample for sample in samples if sample[1] >= goal)

        first, _, startup_cpu = next(sample for sample in samples if sample[1] > 0)
        (t10, n10, cpu10), (t90, n90, cpu90) = at(0.1), at(0.9)
        steady = (n90 - n10) / (t90 - t10) if t90 > t10 else float("nan")
        steady_cpu_us = (cpu90 - cpu10) / (n90 - n10) * 1e6 if n90 > n10 else float("nan")
        run = DrainRun(
            count=args.count,
            wall_seconds=wall,
            first_delivery_seconds=first,
            steady_rate=steady,
            peak_rss_mb=peak_kb / 1024,
            cpu_seconds=cpu,
            startup_cpu_seconds=startup_cpu,
            steady_cpu_us=steady_cpu_us,
            partner_cpu_seconds=partner_cpu,
            machine_busy=busy,
            cpu_groups=groups,
            consumer_runnable=monitor.running_share("consumer"),
            partner=stats,
        )
        ok = (
            states.get("delivered") == args.count
            and stats.get("logical_events") == args.count
            and stats.get("bad_signatures") == 0
        )
        print(
            f"run {number}: {run.wall_seconds:6.2f} s -> {run.rate:6.0f} deliveries/s "
            f"(steady 10-90 %: {run.steady_rate:6.0f}/s; first delivery after "
            f"{run.first_delivery_seconds:.2f} s) | consumer peak RSS {run.peak_rss_mb:5.1f} MB, "
            f"CPU {run.cpu_seconds:5.2f} s = {run.cpu_us_per_delivery:4.0f} us/delivery "
            f"(start-up {run.startup_cpu_seconds:4.2f} s; steady 10-90 %: "
            f"{run.steady_cpu_us:4.0f} us/delivery) "
            f"| partner CPU {partner_cpu:5.2f} s | machine busy {busy:4.0%} | exit {code} | "
            f"ledger {states} | partner {stats} {'OK' if ok else 'MISMATCH'}\n"
            f"   CPU during the drain, all processes: {describe_groups(groups, wall)}\n"
            f"   consumer runnable (R: running or waiting for a CPU, not for I/O) in "
            f"{run.consumer_runnable:.0%} of 20 ms samples\n"
            f"   consumer log events: {_log_summary(env.scratch / 'consumer.log')}",
            flush=True,
        )
        if not ok:
            raise SystemExit("drain benchmark: deliveries and partner counts do not match")
        return run


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--count", type=int, default=20_000, help="queued deliveries (20000)")
    parser.add_argument("--runs", type=int, default=1, help="repeat with fresh state; median")
    parser.add_argument("--prefetch", type=int, default=200, help="RELAY_PREFETCH (200)")
    parser.add_argument("--pool-size", type=int, default=10, help="RELAY_DATABASE_POOL_SIZE (10)")
    parser.add_argument("--write-batch", type=int, default=200, help="RELAY_WRITE_BATCH_MAX (200)")
    parser.add_argument("--log-level", default="INFO", help="consumer RELAY_LOG_LEVEL (INFO)")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra consumer setting, e.g. destination_max_share=1 (RELAY_ prefix added)",
    )
    parser.add_argument(
        "--receiver",
        choices=("lean", "partner"),
        default="lean",
        help="lean: bench/receiver.py (default); partner: the demo partner, relay partner",
    )
    parser.add_argument("--poll", type=float, default=0.1, help="ledger poll interval (s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after (s)")
    parser.add_argument(
        "--profile", default="", help="py-spy raw profile prefix (perturbs the figures)"
    )
    parser.add_argument(
        "--cprofile", default="", help="run the consumer under cProfile (CPU clock); prefix"
    )
    parser.add_argument(
        "--cpu-cap",
        type=float,
        default=0.0,
        metavar="CORES",
        help="run the consumer in a cgroup held to this much CPU, e.g. 0.6 (root; cgroup cpu)",
    )
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    capped = f", consumer capped at {args.cpu_cap} cores" if args.cpu_cap else ""
    print(
        f"== drain benchmark: {args.count} queued webhook deliveries, one consumer{capped}, "
        f"prefetch {args.prefetch}, pool {args.pool_size}, write batch {args.write_batch}, "
        f"log level {args.log_level}, receiver {args.receiver}, {args.runs} run(s); "
        f"load average {load_average()}; "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    cap = CpuCap(args.cpu_cap) if args.cpu_cap else None
    try:
        runs = [await one_run(args, n + 1, cap) for n in range(args.runs)]
    finally:
        if cap is not None:
            cap.remove()
    rate = median([r.rate for r in runs])
    rss = median([r.peak_rss_mb for r in runs])
    cpu = median([r.cpu_us_per_delivery for r in runs])
    print(
        f"median of {len(runs)}: {rate:.0f} deliveries/s "
        f"(target >= {TARGET_RATE:.0f}: {'met' if rate >= TARGET_RATE else 'MISSED'}), "
        f"wall {median([r.wall_seconds for r in runs]):.2f} s, "
        f"steady {median([r.steady_rate for r in runs]):.0f}/s, "
        f"peak RSS {rss:.1f} MB (target < {TARGET_RSS_MB:.0f}: "
        f"{'met' if rss < TARGET_RSS_MB else 'MISSED'}), "
        f"CPU {cpu:.0f} us/delivery (target <= {TARGET_CPU_US:.0f}: "
        f"{'met' if cpu <= TARGET_CPU_US else 'MISSED'}; start-up "
        f"{median([r.startup_cpu_seconds for r in runs]):.2f} s; steady "
        f"{median([r.steady_cpu_us for r in runs]):.0f} us/delivery), "
        f"machine busy {median([r.machine_busy for r in runs]):.0%}"
    )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
