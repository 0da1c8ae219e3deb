"""An experiment, not a product: ``relay purge`` with a pause before each batch's pick
(outside any transaction), to see what capping the purge's rate does to a drain beside it.

    .venv/bin/python bench/purge_under_drain.py \\
        --purge-command ".venv/bin/python bench/throttled_purge.py 0.5"

It wraps ``service.ledger.purge._batched`` (the loop every delivery, run and event step pages
through) and then runs ``relay purge`` as the CLI does; the audit step, a few statements,
is not slowed. Measured in docs/benchmarks.md ("Purge under a drain").
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.ledger import purge
from service.ops import cli


def main() -> int:
    pause = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
    batched = purge._batched

    async def slowed(run: Any, name: str, pick: Any, change: Any, count: Any, *rest: Any) -> None:
        async def slow_pick(at: Any, after: int) -> Any:
            await asyncio.sleep(pause)
            return await pick(at, after)

        await batched(run, name, slow_pick, change, count, *rest)

    purge._batched = slowed  # type: ignore[assignment]
    return cli.main(["purge"])


if __name__ == "__main__":
    sys.exit(main())
