"""The governor's watchdog and ladder choose victims by foresight when given a forecast
(``eviction.policy: foresight``), and say why in each action's evidence.  Pure."""

from __future__ import annotations

from gpulock.core import foresight as fs
from gpulock.governor.model import GovernorConfig, GpuSignals, ResidentView, Snapshot, State
from gpulock.governor.policy import decide

GiB = 1024**3
NOW = 1_700_000_000.0


def view(name: str, idle_s: float) -> ResidentView:
    return ResidentView(
        id=f"1-{name}", name=name, gpu=0, pid=1, policy="persistent", bytes=8 * GiB,
        in_use=False, last_used_wall=NOW - idle_s,
    )  # fmt: skip


def snapshot(forecast: fs.Forecast | None) -> Snapshot:
    # 20 of 24 GiB used, over the 0.8 threshold: one 8 GiB model must leave
    return Snapshot(
        now_wall=NOW, local_minutes=600, gpus=(GpuSignals(0, 24 * GiB, 20 * GiB),),
        residents=(view("digest-model", 3600), view("chat", 900)), forecast=forecast,
    )  # fmt: skip


CONFIG = GovernorConfig(threshold=0.8, min_idle_s=60, samples=100)


def victims(forecast: fs.Forecast | None) -> list[tuple[str | None, dict[str, object]]]:
    actions, _ = decide(snapshot(forecast), State(), CONFIG, NOW)
    return [(a.name, a.evidence) for a in actions if a.kind == "evict"]


def test_without_a_forecast_the_longest_idle_goes() -> None:
    assert [n for n, _ in victims(None)] == ["digest-model"]


def test_with_a_forecast_the_model_needed_last_goes_and_the_evidence_says_why() -> None:
    fc = fs.Forecast(
        NOW,
        {
            "digest-model": fs.NextUse("digest-model", NOW + 120, 0.95, "cron", "digest"),
            "chat": fs.NextUse("chat", None, 0.0, "unknown"),
        },
        {"digest-model": fs.ReloadCost(30.0, "measured")},
    )
    ((name, evidence),) = victims(fc)
    assert name == "chat"
    assert evidence["next_use_source"] == "unknown" and evidence["next_use_s"] is None
    assert evidence["runner_up"] == "1-digest-model"


def tight(forecast: fs.Forecast | None, *, evict_unneeded: bool) -> list[str | None]:
    # 19 of 24 GiB: under the 80 % threshold, within its 5 % hysteresis
    snap = Snapshot(
        now_wall=NOW, local_minutes=600, gpus=(GpuSignals(0, 24 * GiB, 19 * GiB),),
        residents=(view("digest-model", 3600), view("chat", 900)), forecast=forecast,
    )  # fmt: skip
    config = GovernorConfig(
        threshold=0.8, min_idle_s=60, samples=100, evict_unneeded=evict_unneeded
    )
    actions, _ = decide(snap, State(), config, NOW)
    return [a.name for a in actions if a.kind == "evict"]


SOON_AND_NEVER = fs.Forecast(
    NOW,
    {
        "digest-model": fs.NextUse("digest-model", NOW + 120, 0.95, "cron", "digest"),
        "chat": fs.NextUse("chat", None, 0.0, "unknown"),
    },
    {"digest-model": fs.ReloadCost(30.0, "measured")},
)


def test_evict_unneeded_takes_a_model_no_one_expects_when_memory_is_tight() -> None:
    assert tight(SOON_AND_NEVER, evict_unneeded=True) == ["chat"]
    assert tight(SOON_AND_NEVER, evict_unneeded=False) == []  # the default
    assert tight(None, evict_unneeded=True) == []  # no forecast (policy lru): no evidence


def test_a_model_needed_within_ten_reloads_is_kept() -> None:
    fc = fs.Forecast(
        NOW,
        {n: fs.NextUse(n, NOW + 200, 1.0, "rhythm") for n in ("digest-model", "chat")},
        {n: fs.ReloadCost(30.0, "measured") for n in ("digest-model", "chat")},
    )
    assert tight(fc, evict_unneeded=True) == []


def test_evict_unneeded_is_a_boolean_in_the_watchdog_section() -> None:
    import pytest

    from gpulock.core.config import parse_config
    from gpulock.core.errors import ConfigError
    from gpulock.governor.config import load

    assert load(parse_config("watchdog:\n  evict_unneeded: true\n", "c.yaml")).evict_unneeded
    assert not load(parse_config("", "c.yaml")).evict_unneeded
    with pytest.raises(ConfigError, match=r"watchdog\.evict_unneeded"):
        load(parse_config("watchdog:\n  evict_unneeded: yes please\n", "c.yaml"))
