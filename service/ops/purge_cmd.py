"""``relay purge``: the retention policy applied (a CronJob, daily); its arguments are in
``service.ops.cli_purge``.

Prints one summary (``--json``: one document) of what it purged, table by table, after
progress on stderr when that is a terminal; ``--dry-run`` counts the same without changing
anything. Paced: each step does at most ``--rows-per-second`` (default
RELAY_RETENTION_PURGE_ROWS_PER_SECOND) rows a second, and while deliveries are due it
waits between batches (up to ``--yield-seconds`` in all), so a purge beside a drain costs
it little; the summary says the cap, the time paced and the time waited. Exit 0 when every
step ran to its end, 1 when another purge holds the lock (this one did nothing), 2 for a
bad setting or argument, 3 when the database cannot be used. A killed purge is simply run
again: it carries on where the last one stopped.
"""

from __future__ import annotations

import argparse
import sys

from service import crashpoints, db, errors, retention
from service.ledger import purge
from service.ops.deliveries import open_pool, to_json
from service.progress import Progress
from service.settings import Settings


async def main(args: argparse.Namespace, settings: Settings) -> int:
    batch_size = settings.retention_batch_size if args.batch_size is None else args.batch_size
    if not 1 <= batch_size <= 100_000:
        raise errors.ConfigError("--batch-size: must be between 1 and 100000")
    cap = args.rows_per_second
    if cap is None:
        cap = settings.retention_purge_rows_per_second
    elif not 0 <= cap <= 1_000_000:
        raise errors.ConfigError("--rows-per-second: must be between 0 (unpaced) and 1000000")
    bound = args.yield_seconds
    if bound is None:
        bound = settings.retention_purge_yield_seconds
    elif not 0 <= bound <= 86_400:
        raise errors.ConfigError("--yield-seconds: must be between 0 (never waits) and 86400")
    policy = retention.Policy.from_settings(settings)
    async with open_pool(settings) as pool:
        as_of = await pool.fetchval(db.q("db_now"))
        try:
            summary = await purge.purge(
                pool,
                policy,
                as_of,
                batch_size=batch_size,
                rows_per_second=cap,
                yield_seconds=bound,
                dry_run=args.dry_run,
                progress=Progress("purge: rows changed"),
                crashpoints=crashpoints.CrashPoints(settings.crash_at),
            )
        except purge.PurgeBusy as exc:
            print(f"relay: {exc}", file=sys.stderr)
            return errors.ExitCode.INCOMPLETE
    print(to_json(summary.as_dict()) if args.json else summary.render())
    return errors.ExitCode.OK
