"""The README's drill, "At 07:15 on a bad morning", run exactly as written, through the
real `relay` CLI against real PostgreSQL, RabbitMQ and an HTTP partner.

Run N sent the clinics' daily reports; clinic-03's portal is down (503, retrying) and
clinic-04's URL is wrong (404, dead). The operator pauses admission, finds who did not
get it and why, holds the run, fixes the destination, releases the run, replays the dead
delivery by hand, backfills one occurrence that fell due during the pause on purpose
(and not another), and resumes: nothing the pause skipped is sent behind their back.

With RELAY_DRILL_TRANSCRIPT=PATH the commands and their output are written there (the
README's transcript comes from such a run).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg

from service.ops import partner as partner_mod
from service.settings import Settings
from tests.support import relay as rs
from tests.support.relay import RunningPartner

CLINICS = [f"clinic-{i:02d}" for i in range(1, 6)]


class Drill:
    def __init__(self, settings: Settings, workdir: Path) -> None:
        self.settings = settings
        self.workdir = workdir
        self.transcript: list[str] = []

    async def relay(self, *args: str, code: int = 0) -> str:
        result = await rs.relay(self.settings, *args)
        assert result.code == code, (args, result.stdout, result.stderr)
        shown = [a.removeprefix(f"{self.workdir}/") for a in args]  # file names as typed
        self.transcript.append(f"$ relay {shlex.join(shown)}\n{result.stdout.rstrip()}\n")
        return result.stdout

    def save(self) -> None:
        path = os.environ.get("RELAY_DRILL_TRANSCRIPT")
        if path:
            with open(path, "w", encoding="utf-8") as out:
                out.write("\n".join(self.transcript))


async def _states(pool: asyncpg.Pool, run_id: int) -> dict[str, int]:
    rows = await pool.fetch(
        "SELECT state::text AS s, count(*) AS n FROM deliveries WHERE run_id = $1 GROUP BY 1",
        run_id,
    )
    return {r["s"]: r["n"] for r in rows}


def _destination(partner: RunningPartner, clinic: str) -> str:
    path = {"clinic-03": "portal-03", "clinic-04": "wrong-04"}.get(clinic, clinic)
    return partner.url(path)


async def test_at_0715_on_a_bad_morning(
    settings: Settings, pool: asyncpg.Pool, partner: RunningPartner, tmp_path: Path
) -> None:
    # ------------------------------------------------------------------ the bad morning
    settings = settings.model_copy(
        update={
            "publish_lookahead_seconds": 0,
            "retry_base_seconds": 60.0,  # clinic-03 keeps retrying, slowly
            "run_hold_recheck_seconds": 1.0,
        }
    )
    partner.state.rules["portal-03"] = partner_mod.PathRule(status=503)
    partner.state.rules["wrong-04"] = partner_mod.PathRule(status=404)
    seven = datetime.now(UTC).replace(microsecond=0)  # "07:00": run N's reports were due
    await rs.load(pool, [rs.line(c, _destination(partner, c), due_at=seven) for c in CLINICS])
    drill = Drill(settings, tmp_path)
    assert (await rs.relay(settings, "publish")).code == 0
    run_n: int = await pool.fetchval("SELECT max(id) FROM publish_runs")
    async with rs.consumer_in_process(settings):
        await rs.wait_for(
            lambda: _eq(_states(pool, run_n), {"delivered": 3, "retrying": 1, "dead": 1}),
            60,
            "run N's bad morning",
        )
        # Two more clinics' reminders fall due in a few seconds (during the pause).
        soon = datetime.now(UTC) + timedelta(seconds=6)
        await rs.load(
            pool,
            [rs.line(c, partner.url(c), due_at=soon) for c in ("clinic-06", "clinic-07")],
        )
        await _drill(drill, pool, partner, run_n, soon, seven)
    drill.save()


async def _drill(
    drill: Drill,
    pool: asyncpg.Pool,
    partner: RunningPartner,
    run_n: int,
    soon: datetime,
    seven: datetime,
) -> None:
    # 1. Stop admission first.
    assert "admission paused" in await drill.relay("pause")
    assert await pool.fetchval("SELECT paused_at FROM admission_pauses") < soon

    # 2. Who did not get run N, and why.
    status = await drill.relay("status")
    assert "webhook: delivered 3/5 (60.0%), skipped 0, dead 1, pending 1" in status
    assert "admission PAUSED" in status
    missing = await drill.relay("status", "--missing")
    assert f"run {run_n}: 2 not delivered" in missing
    assert "clinic-03" in missing and "clinic-04" in missing
    dead_id: int = await pool.fetchval("SELECT id FROM deliveries WHERE reminder_id = 'clinic-04'")
    story = await drill.relay("deliveries", "show", str(dead_id))
    assert "rejected  404" in story and "/hooks/" not in story

    # 3. Hold the run while the destinations are fixed: no more attempts meanwhile.
    held = await drill.relay(
        "runs",
        "hold",
        str(run_n),
        "--reason",
        "clinic-04 URL wrong, clinic-03 portal down",
        "--apply",
        "--operator",
        "oncall",
    )
    assert "held: 1 rows" in held
    runs = await drill.relay("runs", "list")
    assert "HELD" in runs

    # 4. Fix the destination (clinic-04's URL), and clinic-03's portal is back.
    fixed = drill.workdir / "fixed-clinic-04.jsonl"
    fixed.write_text(rs.line("clinic-04", partner.url("clinic-04"), due_at=seven) + "\n")
    assert "loaded 1 reminders" in await drill.relay("reminders", "load", str(fixed))
    del partner.state.rules["portal-03"]

    # 5. Release the run (clinic-03 is retried at once) and replay clinic-04 by hand.
    released = await drill.relay(
        "runs",
        "release",
        str(run_n),
        "--reason",
        "destinations fixed",
        "--apply",
        "--operator",
        "oncall",
    )
    assert "released" in released
    dry = await drill.relay("replay", "--from", "ledger", "--run", str(run_n))
    assert "would replay=1" in dry
    replayed = await drill.relay(
        "replay", "--from", "ledger", "--run", str(run_n), "--apply", "--operator", "oncall"
    )
    assert "replayed=1" in replayed
    await rs.wait_for(
        lambda: _eq(_states(pool, run_n), {"delivered": 5}), 60, "run N delivered in full"
    )

    # 6. While paused, clinic-06 and clinic-07 fell due. Backfill clinic-06 on purpose.
    await asyncio.sleep(max(0.0, (soon - datetime.now(UTC)).total_seconds()) + 0.5)
    since = (soon - timedelta(seconds=2)).replace(microsecond=0).isoformat()
    would = await drill.relay("backfill", "--all", "--from", since)
    assert "would admit=2 (new 2" in would
    done = await drill.relay(
        "backfill",
        "--reminder",
        "clinic-06",
        "--from",
        since,
        "--apply",
        "--publish",
    )
    assert "admitted=1 (new 1" in done and "published=1" in done
    again = await drill.relay("backfill", "--reminder", "clinic-06", "--from", since, "--apply")
    assert "admitted=0" in again and "no run recorded" in again

    # 7. Resume. The next run records clinic-07 as skipped (paused) and sends nothing twice.
    assert "admission resumed" in await drill.relay("resume")
    await drill.relay("publish")
    await rs.wait_for(lambda: _accepted(partner, "clinic-06"), 30, "clinic-06 delivered")
    rows = {
        r["reminder_id"]: (r["state"], r["skip_reason"])
        for r in await pool.fetch(
            "SELECT reminder_id, state::text AS state, skip_reason FROM deliveries"
            " WHERE reminder_id IN ('clinic-06', 'clinic-07')"
        )
    }
    assert rows == {"clinic-06": ("delivered", None), "clinic-07": ("skipped", "paused")}
    final = await drill.relay("status", "--all-runs", "--runs", "3")
    assert "hold by oncall" in final and "release by oncall" in final
    assert "skipped by reason: paused=1" in final
    report = json.loads(await drill.relay("status", "--run", str(run_n), "--json"))
    assert report["runs"][0]["completion_ratio"] == 1.0
    assert [a["action"] for a in report["runs"][0]["actions"]] == ["hold", "release"]
    assert sorted(partner.state.events.values()) == [1] * 6  # every clinic once, 07 never
    assert not any("clinic-07" in key for key in partner.state.events)


async def _eq(value: object, expected: object) -> bool:
    return bool(await value == expected)  # type: ignore[misc]


async def _accepted(partner: RunningPartner, clinic: str) -> bool:
    return any(clinic in key for key in partner.state.accepted)
