"""relay purge on Kubernetes and in compose: a daily CronJob that never overlaps, runs the real
command with the database alone, and a compose profile that does the same."""

from __future__ import annotations

import zoneinfo

import pytest
from croniter import croniter

from service.settings import Settings
from tests.deploy import support
from tests.deploy.test_compose import interpolate, services


@pytest.mark.parametrize("kustomization", ["base", "overlays/example"])
def test_the_purge_cronjob_runs_daily_never_overlapping_and_is_carried_on_when_stopped(
    kustomization: str,
) -> None:
    objs = support.rendered(kustomization)
    cron = support.find(objs, "CronJob", "relay-purge")
    spec = cron["spec"]
    assert spec["concurrencyPolicy"] == "Forbid"
    assert croniter.is_valid(spec["schedule"])
    zoneinfo.ZoneInfo(spec["timeZone"])
    # Once a day, and the alert's period says so: two missed nights page, not one.
    runs = croniter(spec["schedule"])
    first, second = runs.get_next(float), runs.get_next(float)
    period_hours = float(
        support.config_data(objs).get(
            "RELAY_RETENTION_PURGE_PERIOD_HOURS", Settings().retention_purge_period_hours
        )
    )
    assert second - first == period_hours * 3600 == 86400
    job = spec["jobTemplate"]["spec"]
    assert job["activeDeadlineSeconds"] > 0 and job["backoffLimit"] <= 3
    assert spec["startingDeadlineSeconds"] < second - first  # a late run never piles onto the next
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and set(rule["onExitCodes"]["values"]) == {1, 2}
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    args = support.parse_relay_args(support.container_argv(container), "purge CronJob")
    assert args.command == "purge" and not args.dry_run
    assert rule["onExitCodes"]["containerName"] == container["name"]
    labels = job["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "purge"


def test_the_retention_settings_of_the_configmap_load_and_keep_their_order() -> None:
    data = support.config_data(support.rendered("overlays/example"))
    retention = {k: v for k, v in data.items() if k.startswith("RELAY_RETENTION_")}
    fields = {f"RELAY_{n.upper()}" for n in Settings.model_fields if n.startswith("retention_")}
    assert set(retention) == fields - {"RELAY_RETENTION_BATCH_SIZE"}
    loaded = Settings(**{k.removeprefix("RELAY_").lower(): v for k, v in retention.items()})  # type: ignore[arg-type]
    defaults = Settings()
    for name in retention:
        field = name.removeprefix("RELAY_").lower()
        assert getattr(loaded, field) == getattr(defaults, field), name  # documented defaults


def test_the_compose_purge_profile_runs_relay_purge_daily_after_migrate() -> None:
    purge = services()["purge"]
    assert purge["profiles"] == ["purge"]
    found = support.relay_invocations(interpolate(" ".join(purge["command"])))
    assert found == [["purge"]]
    assert "PURGE_INTERVAL_SECONDS:-86400" in " ".join(purge["command"])
    assert purge["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
