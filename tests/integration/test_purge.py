"""Retention: `relay purge` against a real ledger with a history of every kind
(tests/support/retention.py: deliveries final and open, old and new, with attempts, receipts,
reconciliations, suppressions, events, runs and the audit trail), under the README's default
policy."""

from __future__ import annotations

import io
import json
from datetime import timedelta
from typing import Any

import asyncpg

from service import retention
from service.ledger import purge
from service.progress import Progress
from service.settings import Settings
from tests.support import console as cs
from tests.support import relay as rs
from tests.support import retention as history


async def _purge(settings: Settings, *args: str) -> dict[str, Any]:
    result = await rs.relay(settings, "purge", "--json", *args)
    assert result.code == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {table: n for table, n in counts.items() if n}


async def _rows(pool: asyncpg.Pool, ids: list[int]) -> list[Any]:
    """Every column of these deliveries and of their attempts, receipts, reconciliations."""
    found = []
    for table, column in (
        ("deliveries", "id"),
        ("delivery_attempts", "delivery_id"),
        ("receipts", "delivery_id"),
        ("reconciliations", "delivery_id"),
    ):
        rows = await pool.fetch(f"SELECT * FROM {table} WHERE {column} = ANY($1) ORDER BY 1", ids)
        found.append([dict(r) for r in rows])
    return found


async def test_purge_removes_exactly_what_the_policy_no_longer_keeps_and_never_an_open_row(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    seeded = await history.seed(pool)
    open_ids = [seeded.deliveries[label] for label in history.OPEN]
    open_before = await _rows(pool, open_ids)
    before = await history.counts(pool)

    dry = await _purge(settings, "--dry-run")
    assert await history.counts(pool) == before  # the dry run changed nothing
    first = await _purge(settings, "--batch-size", "2")  # many short batches, same result
    second = await _purge(settings)
    third = await _purge(settings)

    expected_first, expected_second = history.EXPECTED
    for found in (dry, first):
        assert _nonzero(found["content"]) == expected_first["content"]
        assert _nonzero(found["rows"]) == _nonzero(expected_first["rows"])
        assert found["deliveries_by_channel"] == expected_first["deliveries_by_channel"]
    assert (dry["dry_run"], dry["purge_run_id"], first["status"]) == (True, None, "ok")
    assert first["batches"] > 12  # 7 deliveries' rows alone take 4 batches of 2
    # Events and runs whose last delivery went in the first run go in the second.
    assert _nonzero(second["content"]) == expected_second["content"]
    assert _nonzero(second["rows"]) == expected_second["rows"]
    assert _nonzero(third["content"]) == {} and _nonzero(third["rows"]) == {}

    after = await history.counts(pool)
    gone = {t: before[t] - after[t] for t in before}
    rows_first, rows_second = expected_first["rows"], expected_second["rows"]
    assert _nonzero(gone) == _nonzero(
        {t: rows_first.get(t, 0) + rows_second.get(t, 0) for t in before}
    )
    # Open rows are exactly as they were, column by column, with their attempts.
    assert await _rows(pool, open_ids) == open_before
    remaining = {r["id"] for r in await pool.fetch("SELECT id FROM deliveries")}
    assert remaining == set(seeded.deliveries.values()) - {
        seeded.deliveries[label] for label in history.DELETED
    }
    purged = await pool.fetch(
        "SELECT id FROM deliveries WHERE content_purged_at IS NOT NULL ORDER BY id"
    )
    assert [r["id"] for r in purged] == sorted(
        seeded.deliveries[label] for label in history.CONTENT_PURGED
    )


async def _json(settings: Settings, *args: str) -> Any:
    result = await rs.relay(settings, *args, "--json")
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


async def _text(settings: Settings, *args: str) -> str:
    result = await rs.relay(settings, *args)
    assert result.code == 0, result.stderr
    return result.stdout


async def test_the_report_and_deliveries_show_still_say_who_did_not_get_it_and_what_was_purged(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    seeded = await history.seed(pool)
    await _purge(settings)
    run_a, dead = str(seeded.runs["a"]), seeded.deliveries["a_dead"]

    (report,) = (await _json(settings, "status", "--run", run_a))["runs"]
    # The three rows purged whole are still counted, from the run's record.
    assert report["states"] == {"delivered": 1, "skipped": 1, "dead": 2, "retrying": 1}
    assert report["skipped_by_reason"] == {"paused": 1}
    assert report["by_channel"]["sms"]["dead"] == 1 and report["owed"] == 5
    assert (report["content_purged"], report["rows_purged"], report["rows_purged_missing"]) == (
        1,
        3,
        2,
    )
    text = await _text(settings, "status", "--run", run_a)
    assert "content purged (retention): 1 rows keep their ids, states, times" in text
    assert "rows purged (retention): 3 (2 not delivered), counted above" in text

    missing = await _json(settings, "status", "--missing", "--run", run_a)
    assert [r["id"] for r in missing["missing"]] == [dead, seeded.deliveries["a_retrying"]]
    assert missing["missing"][0]["content_purged_at"] is not None
    assert missing["rows_purged_missing"] == 2
    text = await _text(settings, "status", "--missing", "--run", run_a)
    assert "http 404 (content purged)" in text
    assert f"run {run_a}: 2 more not delivered whose rows were purged (retention)" in text

    story = await _json(settings, "deliveries", "show", str(dead))
    assert (story["state"], story["last_status"], story["last_error"]) == ("dead", 404, "http 404")
    assert story["content_purged_at"] is not None
    (attempt,) = story["attempt_history"]
    assert (attempt["http_status"], attempt["reply_excerpt"]) == (404, None)
    text = await _text(settings, "deliveries", "show", str(dead))
    assert "content          purged " in text and "reply: (purged)" in text

    gone = await rs.relay(settings, "deliveries", "show", str(seeded.deliveries["a_delivered"]))
    assert gone.code == 1
    assert "no delivery with id" in gone.stderr and "were purged by retention" in gone.stderr

    runs = await _json(settings, "runs", "list", "--all-runs")
    (listed,) = [r for r in runs["runs"] if r["run_id"] == seeded.runs["a"]]
    assert (listed["owed"], listed["delivered"], listed["rows_purged"]) == (5, 1, 3)


async def test_content_purge_takes_the_payload_and_a_persons_address_but_not_a_partners_endpoint(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    seeded = await history.seed(pool)
    await _purge(settings)
    rows = {
        r["id"]: r
        for r in await pool.fetch(
            "SELECT id, destination, payload, content_purged_at FROM deliveries"
        )
    }
    email, webhook = (seeded.deliveries[k] for k in ("o_email_accepted_20", "o_webhook_40"))
    assert (rows[email]["destination"], rows[email]["payload"]) == (None, None)
    assert rows[webhook]["destination"] == history.HOOK + "o_webhook_40"
    assert rows[webhook]["payload"] is None
    fresh = rows[seeded.deliveries["o_webhook_10"]]
    assert fresh["payload"] == {"text": "private text o_webhook_10"}
    assert fresh["content_purged_at"] is None
    excerpts = await pool.fetch(
        "SELECT delivery_id, response_excerpt FROM delivery_attempts WHERE delivery_id = ANY($1)",
        [email, webhook, seeded.deliveries["o_webhook_10"]],
    )
    assert {r["delivery_id"]: r["response_excerpt"] is None for r in excerpts} == {
        email: True,
        webhook: True,
        seeded.deliveries["o_webhook_10"]: False,
    }
    events = {r["key"]: r["payload"] for r in await pool.fetch("SELECT key, payload FROM events")}
    # e_old's row goes in the next run (its delivery went in this one)
    assert events == {"e_old": None, "e_mid": None, "e_new": {"about": "e_new"}}
    # The suppression a bounce added keeps its delivery (the evidence), content purged.
    kept = seeded.deliveries["o_email_suppressed_100"]
    assert rows[kept]["content_purged_at"] is not None
    assert await pool.fetchval("SELECT count(*) FROM suppressions WHERE delivery_id = $1", kept)


async def test_replay_and_backfills_never_reach_back_into_what_was_purged(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    seeded = await history.seed(pool)
    run_a = str(seeded.runs["a"])
    before = await _json(settings, "replay", "--from", "ledger", "--run", run_a)
    assert before["selected"] == 2  # a_dead and a_sms_dead
    await _purge(settings)
    # a_sms_dead is gone; a_dead's content is: it is never replayed.
    after = await _json(settings, "replay", "--from", "ledger", "--run", run_a)
    assert after["selected"] == 0

    now = await pool.fetchval("SELECT now()")
    refused = await rs.relay(
        settings, "backfill", "--all", "--from", (now - timedelta(days=100)).isoformat()
    )
    assert refused.code == 2
    assert "--from: a backfill cannot tell what was sent" in refused.stderr
    assert "(retention); choose --from at or after it" in refused.stderr
    allowed = await rs.relay(
        settings, "backfill", "--all", "--from", (now - timedelta(days=1)).isoformat()
    )
    assert allowed.code == 0, allowed.stderr

    since = (now - timedelta(days=35)).isoformat()
    refused = await rs.relay(
        settings, "destinations", "subscribe", history.HOOK + "events", history.EVENT_TYPE,
        "--backfill-since", since, ALLOW_NETWORKS="127.0.0.0/8",
    )  # fmt: skip
    assert refused.code == 2
    assert "--backfill-since: events cannot be sent again" in refused.stderr
    since = (now - timedelta(days=20)).isoformat()
    allowed = await rs.relay(
        settings, "destinations", "subscribe", history.HOOK + "events", history.EVENT_TYPE,
        "--backfill-since", since,
    )  # fmt: skip
    assert allowed.code == 0, allowed.stderr


async def test_a_row_someone_holds_is_left_for_the_next_run_never_waited_for(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    seeded = await history.seed(pool)
    held = seeded.deliveries["a_delivered"]
    async with pool.acquire() as conn, conn.transaction():
        await conn.fetch("SELECT id FROM deliveries WHERE id = $1 FOR UPDATE", held)
        # The purge runs to its end while the row is locked: SKIP LOCKED, never a wait.
        first = await _purge(settings)
        assert first["rows"]["deliveries"] == 6
    assert await pool.fetchval("SELECT count(*) FROM deliveries WHERE id = $1", held) == 1
    second = await _purge(settings)
    assert second["rows"]["deliveries"] == 1
    assert await pool.fetchval("SELECT count(*) FROM deliveries WHERE id = $1", held) == 0


async def test_one_purge_at_a_time_and_each_run_is_recorded_for_the_metrics(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    installed = await pool.fetchval("SELECT installed_at FROM retention_horizon")
    assert (await retention.facts(pool)).last_purge_finished == installed.timestamp()
    seeded = await history.seed(pool)
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT pg_try_advisory_lock(72177027)")
        busy = await rs.relay(settings, "purge")
        assert busy.code == 1
        assert "another relay purge is running: this one did nothing" in busy.stderr
        assert (await rs.relay(settings, "purge", "--dry-run")).code == 0  # takes no lock
        await conn.fetchval("SELECT pg_advisory_unlock(72177027)")
    assert await pool.fetchval("SELECT count(*) FROM purge_runs") == 0
    first, second = await _purge(settings), await _purge(settings)

    recorded = await pool.fetch("SELECT * FROM purge_runs ORDER BY id")
    assert [(r["id"], r["status"]) for r in recorded] == [
        (first["purge_run_id"], "ok"),
        (second["purge_run_id"], "ok"),
    ]
    for run, found in zip(recorded, (first, second), strict=True):
        expected = {f"{t}/content": n for t, n in found["content"].items() if n}
        expected |= {f"{t}/rows": n for t, n in found["rows"].items() if n}
        assert run["counts"] == expected
        assert run["policy"] == found["policy"]
    facts = await retention.facts(pool)
    totals = {f"{t}/{k}": n for t, k, n in await pool.fetch("SELECT * FROM purge_totals")}
    assert facts.purged_totals == totals
    assert totals["deliveries/rows"] == 7 and totals["events/rows"] == 1
    assert facts.last_purge_finished == recorded[-1]["finished_at"].timestamp()
    # The oldest final rows kept: a_dead (webhook, 100 days: the dead period is 180) and the
    # suppression's evidence (e-mail); no final SMS is left.
    ages = await pool.fetch(
        "SELECT id, extract(epoch FROM now() - finished_at)::float8 AS age FROM deliveries"
        " WHERE id = ANY($1)",
        [seeded.deliveries["a_dead"], seeded.deliveries["o_email_suppressed_100"]],
    )
    assert set(facts.oldest_final_seconds) == {"webhook", "email"}
    for channel, row in zip(("webhook", "email"), sorted(ages, key=lambda r: r["id"]), strict=True):
        assert abs(facts.oldest_final_seconds[channel] - row["age"]) < 60
    assert set(facts.oldest_content_seconds) == {"webhook"}  # e-mail's content is all purged
    assert facts.oldest_content_seconds["webhook"] < 11 * 86400  # o_webhook_10 and e_new_d


async def test_a_setting_out_of_order_or_a_bad_batch_size_is_exit_2_naming_it(
    settings: Settings,
) -> None:
    bad = await rs.relay(settings, "purge", RETENTION_EMAIL_ROWS_DAYS="7")
    assert bad.code == 2
    assert (
        "RELAY_RETENTION_EMAIL_ROWS_DAYS (7) must be at least RELAY_RETENTION_EMAIL_CONTENT_DAYS"
        " (14)" in bad.stderr
    )
    bad = await rs.relay(settings, "purge", "--batch-size", "0")
    assert bad.code == 2 and "--batch-size: must be between 1 and 100000" in bad.stderr


async def test_the_console_says_what_was_purged_too(settings: Settings, pool: asyncpg.Pool) -> None:
    seeded = await history.seed(pool)
    await _purge(settings)
    dead, run_a = seeded.deliveries["a_dead"], seeded.runs["a"]
    async with cs.console(settings) as c:
        async with cs.client(headers=cs.bearer("ops-bot")) as http:
            async with http.get(f"{c.url}/api/v1/deliveries/{dead}") as answer:
                story = await answer.json()
            assert story["content_purged_at"] is not None
            assert [a["response_excerpt"] for a in story["attempt_list"]] == [None]
            async with http.get(f"{c.url}/api/v1/runs") as answer:
                (run,) = [r for r in (await answer.json())["runs"] if r["run_id"] == run_a]
            assert run["states"] == {"delivered": 1, "skipped": 1, "dead": 2, "retrying": 1}
            assert (run["content_purged"], run["rows_purged"]) == (1, 3)
        async with cs.client() as http:
            await cs.log_in(http, c.url)
            async with http.get(f"{c.url}/deliveries/{dead}") as page:
                text = await page.text()
            assert 'id="delivery-content-purged"' in text and "(retention)" in text


async def test_an_erasure_after_a_purge_leaves_what_retention_emptied_empty(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    seeded = await history.seed(pool)
    await _purge(settings)
    erased = await rs.relay(
        settings,
        "erase",
        "--recipient",
        history.HOOK + "o_webhook_40",
        "--reason",
        "partner asked",
        "--apply",
        ALLOW_NETWORKS="127.0.0.0/8",
    )
    assert erased.code == 0, erased.stderr
    row = await pool.fetchrow(
        "SELECT destination, payload, content_purged_at, erased_at FROM deliveries WHERE id = $1",
        seeded.deliveries["o_webhook_40"],
    )
    assert row is not None
    assert (row["destination"], row["payload"]) == ("erased", None)
    assert row["content_purged_at"] is not None and row["erased_at"] is not None
    # And a purge after the erasure goes on as before.
    assert _nonzero((await _purge(settings))["rows"]) == history.EXPECTED[1]["rows"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_the_python_api_purges_as_of_any_instant_and_shows_progress_on_a_terminal(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    """What a benchmark calls: ``purge(pool, policy, as_of, batch_size=...)``."""
    seeded = await history.seed(pool)
    policy = retention.Policy.from_settings(settings)
    now = await pool.fetchval("SELECT now()")
    screen = _Terminal()
    first = await purge.purge(
        pool, policy, now, batch_size=3, progress=Progress("purge", screen, every_seconds=0)
    )
    assert _nonzero(first.content) == history.EXPECTED[0]["content"]
    assert "\rpurge: " in screen.getvalue() and screen.getvalue().endswith("\r\x1b[K")
    # A thousand days on, every final row has gone but a suppression's evidence; open ones stay.
    later = await purge.purge(pool, policy, now + timedelta(days=1000), batch_size=3)
    assert later.status == "ok"
    kept = {r["id"] for r in await pool.fetch("SELECT id FROM deliveries")}
    assert kept == {seeded.deliveries[label] for label in (*history.OPEN, "o_email_suppressed_100")}
    # Runs a and d keep their open rows (a_retrying, d_pending), so they stay.
    runs = {r["id"] for r in await pool.fetch("SELECT id FROM publish_runs")}
    assert runs == {seeded.runs["a"], seeded.runs["d"]}


async def test_a_row_this_run_deletes_is_not_stripped_first_and_one_it_keeps_is(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    spec = history.Spec
    ids = await history.seed_final(pool, [
        spec("gone_webhook_100", "webhook", "delivered", 100),  # past content 30 and rows 90
        spec("gone_sms_dead_200", "sms", "dead", 200),  # past the dead rows period, 180
        spec("gone_email_70", "email", "delivered", 70),  # past e-mail rows, 60 here
        spec("kept_webhook_70", "webhook", "delivered", 70),  # webhook rows: 90
        spec("kept_webhook_dead_100", "webhook", "dead", 100),  # past dead content 90 only
        spec("kept_email_evidence_100", "email", "bounced", 100, bounce="kept"),  # evidence
    ])  # fmt: skip
    env = {"RETENTION_EMAIL_ROWS_DAYS": "60"}
    runs = []
    for args in (("--dry-run",), ()):
        result = await rs.relay(settings, "purge", "--json", *args, **env)
        assert result.code == 0, result.stderr
        runs.append(json.loads(result.stdout))
    for found in runs:  # the dry run says what the run does
        assert found["deliveries_by_channel"] == {
            "content": {"webhook": 2, "email": 1},
            "rows": {"webhook": 1, "email": 1, "sms": 1},
        }
        assert (found["content"]["deliveries"], found["rows"]["deliveries"]) == (3, 3)
    left = await pool.fetch(
        "SELECT id, content_purged_at IS NOT NULL AS stripped, payload FROM deliveries"
    )
    assert {r["id"]: (r["stripped"], r["payload"]) for r in left} == {
        ids[label]: (True, None)
        for label in ("kept_webhook_70", "kept_webhook_dead_100", "kept_email_evidence_100")
    }
    totals = {f"{t}/{k}": n for t, k, n in await pool.fetch("SELECT * FROM purge_totals")}
    assert (totals["deliveries/content"], totals["deliveries/rows"]) == (3, 3)
