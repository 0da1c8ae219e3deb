"""Rate-budget benchmark: limiter overhead, and accuracy across replicas.

1. Overhead: ``bench/drain.py`` twice on the same count, without budgets and with a
   budget far above the drain rate (so it never binds): deliveries/s and CPU per delivery.
2. Accuracy: REPLICAS ``relay consume`` processes share one budget (RATE/s, burst BURST)
   over COUNT queued deliveries to a receiver in this process that records the arrival
   time of every request: per-second arrivals, the largest one-second overshoot above the
   rate (first second: above rate + burst), and the drain time against COUNT / RATE.

    .venv/bin/python bench/budget.py                       # overhead at 10,000 + accuracy
    .venv/bin/python bench/budget.py --skip-overhead --rate 100 --burst 10 --count 3000
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RELAY, REPO, bench_env, check, run_measured, state_counts, write_reminders

from service.ops import partner as partner_mod

_FIGURES = re.compile(r"median of \d+: (\d+) deliveries/s.*CPU (\d+) us/delivery")


def overhead(count: int, runs: int) -> None:
    results = {}
    for label, extra in (("off", []), ("on", ["--env", "budgets=webhook=100000/1000"])):
        out = subprocess.run(
            [
                sys.executable,
                str(REPO / "bench" / "drain.py"),
                "--count",
                str(count),
                "--runs",
                str(runs),
                *extra,
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
        ).stdout
        match = _FIGURES.search(out)
        assert match, out[-2000:]
        results[label] = (int(match.group(1)), int(match.group(2)))
        print(
            f"   budgets {label:>3}: {results[label][0]} deliveries/s, "
            f"{results[label][1]} us CPU/delivery",
            flush=True,
        )
    off, on = results["off"][0], results["on"][0]
    print(
        f"overhead: {100 * (off - on) / off:+.1f} % deliveries/s with budgets on (target <= 10 %)",
        flush=True,
    )


async def accuracy(count: int, rate: float, burst: float, replicas: int) -> None:
    arrivals: list[float] = []
    partner = partner_mod.Partner()
    partner.on_request = lambda name, key: arrivals.append(time.monotonic())
    runner, port = await partner_mod.start(partner)
    try:
        async with bench_env("budget") as env:
            path = env.scratch / "reminders.jsonl"
            write_reminders(path, count, f"http://127.0.0.1:{port}/hooks/bench")
            check(
                run_measured(
                    [*RELAY, "reminders", "load", str(path)], env.env(), env.scratch, "load"
                ),
                "load",
            )
            check(run_measured([*RELAY, "publish"], env.env(), env.scratch, "publish"), "publish")
            settings = {"budgets": f"webhook={rate:g}/{burst:g}", "lease_seconds": "120"}
            consumers = [
                subprocess.Popen(  # noqa: ASYNC220 - started once, never awaited
                    [*RELAY, "consume"],
                    env=env.env(**settings),
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for _ in range(replicas)
            ]
            started = time.monotonic()
            import asyncpg

            pool = await asyncpg.create_pool(env.database_url, min_size=1, max_size=1)
            try:
                deadline = started + count / rate * 3 + 30
                while (await state_counts(pool)).get("delivered", 0) < count:
                    if time.monotonic() > deadline:
                        raise SystemExit("accuracy run did not finish in time")
                    await asyncio.sleep(0.25)
            finally:
                await pool.close()
            elapsed = time.monotonic() - started
            for proc in consumers:
                proc.send_signal(signal.SIGTERM)
            for proc in consumers:
                proc.wait(30)
    finally:
        await runner.cleanup()
    first = arrivals[0]
    per_second = Counter(int(t - first) for t in arrivals)
    seconds = range(int(arrivals[-1] - first) + 1)
    counts = [per_second[s] for s in seconds]
    overshoot = max([c - rate for c in counts[1:]] or [0])
    print(
        f"   per-second arrivals: first {counts[0]} (rate + burst = {rate + burst:g}), "
        f"then min {min(counts[1:-1] or [0])} / max {max(counts[1:] or [0])}"
    )
    print(
        f"accuracy: {replicas} replicas, budget {rate:g}/s burst {burst:g}: max 1-second "
        f"overshoot above the rate {overshoot:+g} (first second {counts[0] - rate - burst:+g} "
        f"above rate + burst); {count} in {elapsed:.1f} s = "
        f"{100 * (elapsed / (count / rate) - 1):+.1f} % against {count}/{rate:g} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overhead-count", type=int, default=10000)
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=100)
    parser.add_argument("--burst", type=float, default=10)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--runs", type=int, default=3, help="drain runs per side (median)")
    args = parser.parse_args()
    print(f"== budget benchmark ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    if not args.skip_overhead:
        overhead(args.overhead_count, args.runs)
    asyncio.run(accuracy(args.count, args.rate, args.burst, args.replicas))


if __name__ == "__main__":
    main()
