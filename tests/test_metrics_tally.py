"""The metrics' pure parts: events -> tally, (snapshot, tally) -> families, by table.

No state folder, no process: the fold and the families are functions of their arguments.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("prometheus_client", reason="the 'metrics' extra is not installed")

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpulock.metrics import specs
from gpulock.metrics.families import families
from gpulock.metrics.tally import MAX_SERIES, OTHER, Tally, eviction_reason, fold

GiB = 1024**3


def tally_of(*events: dict[str, Any]) -> Tally:
    t = Tally()
    for e in events:
        fold(t, {"ts": 1.0, **e})
    return t


def samples(
    snap: dict[str, Any], tally: Tally
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, parsed back by prometheus_client's own parser."""

    class One:
        def collect(self) -> Any:
            return families(snap, tally)

    text = generate_latest(One()).decode()  # type: ignore[arg-type]
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


EMPTY: dict[str, Any] = {"gpus": [], "devices": [], "residents": [], "governor": None}


# --- the fold, event by event -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("events", "metric", "labels", "value"),
    [
        (
            [{"event": "acquire", "gpu": 0, "name": "digest", "waited_s": 2.0}] * 3,
            "gpulock_grants",
            ("0", "digest"),
            3,
        ),
        ([{"event": "timeout", "gpu": 1, "name": "tts"}], "gpulock_timeouts", ("1", "tts"), 1),
        (
            [{"event": "cleanup", "gpu": 0, "ticket": 4, "holding": True}],
            "gpulock_cut_short_holds",
            ("0", "owner-gone"),
            1,
        ),
        (  # a waiter's ticket cleaned up is no hold cut short
            [{"event": "cleanup", "gpu": 0, "ticket": 4, "holding": False}],
            "gpulock_cut_short_holds",
            ("0", "owner-gone"),
            None,
        ),
        (
            [{"event": "break", "gpu": 0, "action": "killed", "reason": "hung: past its lease"}],
            "gpulock_cut_short_holds",
            ("0", "hung"),
            1,
        ),
        (
            [{"event": "break", "gpu": 0, "action": "killed", "reason": "forced"}],
            "gpulock_cut_short_holds",
            ("0", "forced"),
            1,
        ),
        (
            [
                {
                    "event": "evict",
                    "reason": "governor evict: gpu0 75% used > 50%",
                    "outcome": "freed",
                    "freed_bytes": 4 * GiB,
                }
            ]
            * 2,
            "gpulock_evictions",
            ("governor-evict", "freed", ""),
            2,
        ),
        (
            [{"event": "evict", "reason": "requested", "outcome": "freed", "freed_bytes": GiB}],
            "gpulock_evicted_bytes",
            ("request", ""),
            GiB,
        ),
        (
            [
                {
                    "event": "evict",
                    "reason": "tenant ollama",
                    "outcome": "freed",
                    "tenant": "ollama",
                }
            ],
            "gpulock_evictions",
            ("tenant", "freed", "ollama"),
            1,
        ),
        ([{"event": "oom", "gpu": 0}], "gpulock_ooms", ("0",), 1),
        (
            [{"event": "escalate", "level": "reduce"}],
            "gpulock_governor_escalations",
            ("reduce",),
            1,
        ),
        (
            [{"event": "deescalate", "level": "normal"}],
            "gpulock_governor_deescalations",
            ("normal",),
            1,
        ),
        (
            [{"event": "route", "task": "summarize", "tier": None}],
            "gpulock_router_routes",
            ("summarize", "none"),
            1,
        ),
        (
            [
                {
                    "event": "call",
                    "task": "t",
                    "tier": "cloud",
                    "model": "m",
                    "ok": True,
                    "tokens_in": 10,
                    "tokens_out": 5,
                    "cost_usd": 0.25,
                    "latency_s": 0.3,
                }
            ]
            * 2,
            "gpulock_router_calls",
            ("t", "cloud", "m", "ok", ""),
            2,
        ),
        (
            [
                {
                    "event": "call",
                    "task": "t",
                    "tier": "cloud",
                    "model": "m",
                    "ok": True,
                    "tokens_in": 10,
                    "tokens_out": 5,
                    "cost_usd": 0.25,
                    "latency_s": 0.3,
                }
            ]
            * 2,
            "gpulock_router_cost_usd",
            ("t", "cloud", "m"),
            0.5,
        ),
        (
            [{"event": "call", "task": "t", "tier": "gpu", "model": "m", "ok": False}],
            "gpulock_router_calls",
            ("t", "gpu", "m", "error", ""),
            1,
        ),
        (
            [{"event": "fallback", "task": "t", "from_tier": "cloud", "to_tier": "cpu"}],
            "gpulock_router_fallbacks",
            ("t", "cloud"),
            1,
        ),
        # Garbage is counted as nothing, never a crash or a negative counter.
        (
            [{"event": "evict", "freed_bytes": -5, "outcome": "freed"}],
            "gpulock_evicted_bytes",
            ("other", ""),
            None,
        ),
        (
            [{"event": "acquire", "gpu": "0; drop", "name": {"x": 1}}],
            "gpulock_grants",
            ("", ""),
            1,
        ),
        (
            [{"event": "call", "tokens_in": float("nan"), "ok": True}],
            "gpulock_router_input_tokens",
            ("", "", ""),
            None,
        ),
        ([{"event": "no-such-kind", "gpu": 0}], "gpulock_grants", ("0", ""), None),
    ],
)
def test_fold_counts_each_event_kind(
    events: list[dict[str, Any]], metric: str, labels: tuple[str, ...], value: float | None
) -> None:
    t = tally_of(*events)
    assert t.counters.get(metric, {}).get(labels) == value, t.counters


def test_waits_and_holds_fall_into_inclusive_buckets() -> None:
    t = tally_of(
        {"event": "acquire", "gpu": 0, "name": "a", "waited_s": 1},  # le="1.0" exactly
        {"event": "acquire", "gpu": 0, "name": "a", "waited_s": 45},
        {"event": "acquire", "gpu": 0, "name": "a", "waited_s": 1e9},  # past the last: +Inf
        {"event": "release", "gpu": 0, "held_s": 0.2},
    )
    got = samples(EMPTY, t)
    wait = "gpulock_wait_seconds"
    assert got[(f"{wait}_bucket", (("gpu", "0"), ("le", "0.5")))] == 0
    assert got[(f"{wait}_bucket", (("gpu", "0"), ("le", "1.0")))] == 1
    assert got[(f"{wait}_bucket", (("gpu", "0"), ("le", "60.0")))] == 2
    assert got[(f"{wait}_bucket", (("gpu", "0"), ("le", "14400.0")))] == 2
    assert got[(f"{wait}_bucket", (("gpu", "0"), ("le", "+Inf")))] == 3
    assert got[(f"{wait}_count", (("gpu", "0"),))] == 3
    assert got[(f"{wait}_sum", (("gpu", "0"),))] == 1 + 45 + 1e9
    assert got[("gpulock_hold_seconds_count", (("gpu", "0"),))] == 1


@pytest.mark.parametrize(
    ("reason", "word"),
    [
        ("requested", "request"),
        ("room for ticket 12 (digest)", "make-room"),
        ("governor evict: gpu0 75% used > 50%", "governor-evict"),
        ("governor force-evict: vram.gpu0 over 95%", "governor-force-evict"),
        ("something new", "other"),
        (None, "other"),
    ],
)
def test_eviction_reasons_become_a_few_words(reason: Any, word: str) -> None:
    assert eviction_reason(reason) == word


def test_a_family_full_of_series_puts_new_label_values_under_other() -> None:
    t = tally_of(
        *({"event": "timeout", "gpu": 0, "name": f"job-{i}"} for i in range(MAX_SERIES + 50))
    )
    series = t.counters["gpulock_timeouts"]
    assert len(series) == MAX_SERIES + 1
    assert series[("0", OTHER)] == 50
    assert all(len(v) <= 64 for k in series for v in k)


def test_tally_round_trips_through_json_and_drops_damaged_rows() -> None:
    t = tally_of(
        {"event": "acquire", "gpu": 0, "name": "a", "waited_s": 3},
        {"event": "evict", "reason": "requested", "outcome": "freed", "freed_bytes": 7},
    )
    obj = json.loads(json.dumps(t.to_json()))
    assert Tally.from_json(obj) == t
    obj["counters"]["gpulock_grants"].append([["0"], 5])  # wrong label count
    obj["counters"]["gpulock_grants"].append([["0", "b"], -1])  # negative
    obj["counters"]["gpulock_nonsense"] = [[[], 1]]
    obj["histograms"]["gpulock_wait_seconds"][0][1] = [1, 2]  # wrong bucket count
    back = Tally.from_json(obj)
    assert back.counters["gpulock_grants"] == {("0", "a"): 1.0}
    assert "gpulock_wait_seconds" not in back.histograms
    assert Tally.from_json("garbage") == Tally()


# --- the families, from a snapshot ---------------------------------------------------------------

SNAP: dict[str, Any] = {
    "generated_wall": 1000.0,
    "gpus": [
        {
            "gpu": 0,
            "total_bytes": 12 * GiB,
            "reserve_bytes": GiB,
            "holders": [
                {"name": "a", "state": "holding", "need_bytes": 2 * GiB, "created_wall": 900.0},
                {"name": "b", "state": "hung", "need_bytes": 3 * GiB, "created_wall": 900.0},
            ],
            "waiters": [
                {"name": "c", "state": "waiting", "need_bytes": None, "created_wall": 990.0},
                {"name": "d", "state": "waiting", "need_bytes": None, "created_wall": 940.0},
                {"name": "e", "state": "dead", "need_bytes": None, "created_wall": 100.0},
            ],
        },
        {"gpu": 1, "total_bytes": None, "reserve_bytes": None, "holders": [], "waiters": []},
    ],
    "devices": [
        {"index": 0, "total_bytes": 12 * GiB, "used_bytes": 9 * GiB, "free_bytes": 3 * GiB},
        {"index": 1, "total_bytes": None, "used_bytes": None, "free_bytes": None},
    ],
    "residents": [
        {
            "name": "qwen",
            "user": "ana",
            "gpu": 0,
            "bytes": 4 * GiB,
            "policy": "persistent",
            "in_use": True,
            "owner": "4711-99",
        },
        {
            "name": "qwen",
            "user": "ana",
            "gpu": 0,
            "bytes": 1 * GiB,
            "policy": "persistent",
            "in_use": False,
        },
        {
            "name": "llama3",
            "user": "",
            "gpu": 0,
            "bytes": None,
            "policy": "pinned",
            "in_use": False,
            "tenant": "ollama",
        },
    ],
    "governor": {
        "live": True,
        "level": "evict-idle",
        "updated_wall": 995.0,
        "signals": {
            "gpus": [{"index": 0, "used_fraction": 0.75, "fragmentation_bytes": None}],
            "psi_some_avg10": 1.5,
            "psi_full_avg10": None,
            "swap_bytes_per_s": 0.0,
            "oom_reports": 0,
        },
        "thresholds": {"threshold": 0.5, "vram_pressure": 0.95, "unregistered_bytes": None},
    },
    "usage": {"cloud_spend_usd": 1.25, "daily_budget_usd": 5.0},
}


@pytest.mark.parametrize(
    ("name", "labels", "value"),
    [
        ("gpulock_queue_holders", {"gpu": "0"}, 2),  # hung still holds
        ("gpulock_queue_waiters", {"gpu": "0"}, 2),  # dead does not wait
        ("gpulock_queue_stale", {"gpu": "0"}, 2),
        ("gpulock_queue_oldest_wait_seconds", {"gpu": "0"}, 60.0),
        ("gpulock_queue_waiters", {"gpu": "1"}, 0),
        ("gpulock_queue_oldest_wait_seconds", {"gpu": "1"}, 0),
        ("gpulock_queue_claimed_bytes", {"gpu": "0", "owner": "b"}, 3 * GiB),
        ("gpulock_gpu_memory_claimed_bytes", {"gpu": "0"}, 5 * GiB),
        ("gpulock_gpu_memory_total_bytes", {"gpu": "0"}, 12 * GiB),
        ("gpulock_gpu_memory_used_bytes", {"gpu": "0"}, 9 * GiB),
        ("gpulock_gpu_memory_free_bytes", {"gpu": "0"}, 3 * GiB),
        ("gpulock_gpu_memory_reserved_bytes", {"gpu": "0"}, GiB),
        ("gpulock_gpu_memory_used_bytes", {"gpu": "1"}, None),  # unknown: absent, never 0
        ("gpulock_gpu_memory_total_bytes", {"gpu": "1"}, None),
        (  # two records of one model by one user: one series, summed
            "gpulock_resident_bytes",
            {"gpu": "0", "model": "qwen", "owner": "ana", "tenant": "", "policy": "persistent"},
            5 * GiB,
        ),
        ("gpulock_resident_models", {"gpu": "0", "tenant": ""}, 2),
        ("gpulock_resident_models", {"gpu": "0", "tenant": "ollama"}, 1),
        ("gpulock_resident_in_use", {"gpu": "0", "tenant": ""}, 1),
        ("gpulock_governor_up", {}, 1),
        ("gpulock_governor_level", {"level": "evict-idle"}, 1),
        ("gpulock_governor_level", {"level": "normal"}, 0),
        ("gpulock_governor_level_index", {}, 2),
        ("gpulock_governor_signal", {"signal": "used_fraction", "gpu": "0"}, 0.75),
        ("gpulock_governor_signal", {"signal": "psi_some_avg10", "gpu": ""}, 1.5),
        ("gpulock_governor_signal", {"signal": "psi_full_avg10", "gpu": ""}, None),
        ("gpulock_governor_threshold", {"signal": "used_fraction"}, 0.95),
        ("gpulock_governor_threshold", {"signal": "watchdog_used_fraction"}, 0.5),
        ("gpulock_governor_threshold", {"signal": "unregistered_bytes"}, None),
        ("gpulock_governor_last_pass_timestamp_seconds", {}, 995.0),
        ("gpulock_router_cloud_spend_today_usd", {}, 1.25),
        ("gpulock_router_daily_budget_usd", {}, 5.0),
    ],
)
def test_gauges_show_the_snapshot(name: str, labels: dict[str, str], value: float | None) -> None:
    got = samples(SNAP, Tally())
    assert got.get((name, tuple(sorted(labels.items())))) == value


def test_no_label_is_a_pid_or_a_ticket() -> None:
    got = samples(
        SNAP,
        tally_of(
            {"event": "acquire", "gpu": 0, "ticket": 7, "pid": 4711, "name": "a", "waited_s": 1}
        ),
    )
    names = {k for _, labels in got for k, _ in labels}
    assert not names & {"pid", "ticket", "id", "resident"}, names
    assert not any(v == "4711-99" for _, labels in got for _, v in labels)


def test_a_dead_governor_shows_level_normal_and_down() -> None:
    snap = {**SNAP, "governor": {**SNAP["governor"], "live": False}}
    got = samples(snap, Tally())
    assert got[("gpulock_governor_up", ())] == 0
    assert got[("gpulock_governor_level", (("level", "normal"),))] == 1
    assert got[("gpulock_governor_level_index", ())] == 0


def test_every_family_is_declared_in_specs_and_listed_even_without_samples() -> None:
    fams = families(EMPTY, Tally())
    assert [f.name for f in fams] == [
        s.name for s in (*specs.COUNTERS, *specs.HISTOGRAMS, *specs.GAUGES)
    ]
    for s in specs.ALL:
        assert s.name.startswith("gpulock_")
        assert not s.name.endswith("_total")
        assert ("pid" not in s.labels) and ("ticket" not in s.labels)
